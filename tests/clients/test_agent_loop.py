"""Claude Code's agent loop through the gateway: a scripted replica answers
with a ``Read`` tool call, Claude Code runs the tool, and its next request carries the
``tool_result`` with the file's content. The replica is scripted, so the loop is tested
here; the cache numbers of a real session are test_claude_code.py's."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachepoint.gateway.app import create_app
from cachepoint.gateway.observability.requestlog import LOGGER
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.tokenizer import load_tokenizer

from ..gateway.scripted import MODEL, Script, StaticRouter, scripted_replica, seed
from .harness import claude_env, ledger, run_claude

SENTINEL = "cachepoint-sentinel-7d1f: the Read tool ran"
DONE = "Read it; done."
# NOTE: Claude Code's prompt is about 50 kB; with the scripted gateway's byte tokenizer
# that is as many tokens, past the 8,192-token default window.
WINDOW = 262_144


def call_read(path: Path) -> list[str]:
    """A model's token texts for one Read call, the tags cut across tokens."""
    args = json.dumps({"name": "Read", "arguments": {"file_path": str(path)}})
    return ["Let me look.\n<tool", "_call>\n", args[:20], args[20:], "\n</tool_call>"]


def answering(script: Script, choose: Callable[[str], list[str]]) -> Any:
    """The scripted replica, its token texts chosen per request from the prompt's text
    (the gateway's byte tokenizer makes token ids bytes), so side requests Claude Code
    may send in between cannot shift a fixed order of answers."""
    app = scripted_replica(script)
    tokenizer = load_tokenizer(None)

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/generate":
            await app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        # NOTE: set before the app reads it, with no await in between on this side.
        script.texts = choose(tokenizer.decode(json.loads(raw)["token_ids"]))
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await app(scope, replay, send)

    return asgi


def test_claude_code_runs_read_and_sends_the_tool_result(serve, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)  # the gateway's request lines
    project = tmp_path / "project"
    project.mkdir()
    target = project / "notes.txt"
    target.write_text(SENTINEL + "\n")

    def choose(prompt: str) -> list[str]:
        return [DONE] if SENTINEL in prompt else call_read(target)

    script = Script(once=True, stop_reason="end_turn")
    db = f"sqlite:///{tmp_path}/gw.db"
    keys = seed(db)
    router = StaticRouter(serve(answering(script, choose)))
    settings = GatewaySettings(database_url=db, max_context_tokens=WINDOW)
    url = serve(create_app(settings, router=router))

    env = claude_env(url, keys["a"], tmp_path / "home", WINDOW)
    r = run_claude(
        ["-p", "What does notes.txt say?", "--model", MODEL, "--allowedTools", "Read"],
        project,
        env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert DONE in r.stdout
    # NOTE: Claude Code retries some 400s with a fallback request and still exits 0;
    # the gateway must have answered every request it sent.
    statuses = [rec.fields["status"] for rec in caplog.records if rec.name == LOGGER]
    assert statuses and all(s == 200 for s in statuses), statuses

    tokenizer = load_tokenizer(None)
    prompts = [tokenizer.decode(b["token_ids"]) for b in script.bodies]
    calls = [i for i, p in enumerate(prompts) if SENTINEL not in p]
    results = [i for i, p in enumerate(prompts) if SENTINEL in p]
    assert calls and results, f"{len(prompts)} requests, none with the file's content"
    # The follow-up came after the call and resends the call's turn before the result.
    follow_up = prompts[results[0]]
    assert results[0] > calls[0]
    assert str(target) in follow_up
    assert follow_up.index(str(target)) < follow_up.index(SENTINEL)

    # The follow-up can read the previous turn's cache: up to that turn's last
    # breakpoint it sends the same tokens under the same keys, so a real replica finds
    # the entry the call's turn wrote (the cache numbers of this scripted replica are
    # its own; tests/clients/test_claude_code.py measures real ones).
    call, result = script.bodies[calls[0]], script.bodies[results[0]]
    last = max(bp["position"] for bp in call["breakpoints"])
    assert result["token_ids"][:last] == call["token_ids"][:last]
    assert result["key_spans"] == call["key_spans"]
    assert any(bp["position"] > last for bp in result["breakpoints"])  # it writes on

    rows = ledger(db)
    assert len(rows) == len(script.bodies)
    assert len({row.session_id for row in rows}) == 1
