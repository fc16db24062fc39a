"""Claude Code 2.1.328, unmodified, against `cachepoint up`'s embedded stack:
a three-turn session with a fresh HOME, judged by what the gateway logged and billed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cachepoint.embedded.stack import DEMO_ORG, Stack
from cachepoint.replica.random_model import RANDOM_CONTEXT

from .harness import (
    CLAUDE,
    CLAUDE_VERSION,
    RANDOM_TURN_TOKENS,
    claude_env,
    installed,
    ledger,
    miss_of,
    request_log,
    run_claude,
    transcript_sessions,
)

PROMPTS = ["say hi", "now say it in French", "and once more in German"]
ADMIN = [sys.executable, "-m", "cachepoint.gateway.admin.cli"]


def test_claude_code_is_the_pinned_native_binary() -> None:
    out = subprocess.run(
        [str(installed(CLAUDE)), "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{CLAUDE_VERSION} (Claude Code)"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_claude_code_session_reads_the_cache_and_bills_one_session(
    tmp_path: Path, free_port
) -> None:
    stack = Stack(
        tmp_path / "state",
        replicas=1,
        port=free_port(),
        tracing=False,
        random_turn_tokens=RANDOM_TURN_TOKENS,
    )
    stack.start()
    try:
        home, project = tmp_path / "home", tmp_path / "project"
        project.mkdir()
        (project / "README.md").write_text("A project Claude Code works in.\n")
        env = claude_env(stack.base_url, stack.keys["api_key"], home, RANDOM_CONTEXT)
        turns: list[list[str]] = []  # per claude call: the ledger rows it added
        seen = 0
        for i, prompt in enumerate(PROMPTS):
            # NOTE: no --model: Claude Code asks for its default Claude model, which
            # the stack's "claude-*" alias serves with its own.
            args = ["-p", prompt]
            if i:
                args.insert(0, "--continue")
            r = run_claude(args, project, env)
            assert r.returncode == 0, f"turn {i + 1}: {r.stdout}{r.stderr}"
            rows = ledger(stack.db_url)
            turns.append([row.request_id for row in rows[seen:]])
            seen = len(rows)
            assert turns[-1], f"turn {i + 1} billed nothing"

        log = request_log(stack.state_dir / "logs")
        failed = [(r["path"], r["status"], r["error_type"]) for r in log if r["status"] >= 400]
        assert not failed, failed

        rows = {row.request_id: row for row in ledger(stack.db_url)}
        for n in (2, 3):
            # NOTE: a turn's main request is its longest prompt (a side request, if any,
            # is shorter); it resends the history the previous turn cached.
            main = max((rows[rid] for rid in turns[n - 1]), key=lambda r: r.prompt_tokens)
            assert main.read_share >= 0.9, (n, main)

        sessions = {row.session_id for row in rows.values()}
        assert len(sessions) == 1 and None not in sessions, sessions
        # The id billed is the one Claude Code keeps the session's transcript under.
        assert sessions <= transcript_sessions(home)

        # A second session in the same project, from a subdirectory: the same tools,
        # a system text that names another working directory. Cache diagnostics (no
        # opt-in: the session header is enough) puts the break on the system text.
        sub = project / "docs"
        sub.mkdir()
        r = run_claude(["-p", PROMPTS[0]], sub, env)
        assert r.returncode == 0, f"second session: {r.stdout}{r.stderr}"
        later = ledger(stack.db_url)[seen:]
        main = max(later, key=lambda row: row.prompt_tokens)
        assert main.session_id not in sessions
        reason, missed = miss_of(stack.db_url, main.request_id)
        assert reason == "system_changed", (reason, missed, main)
        # The tools' blocks were shared and read: what was missed is the rest of what
        # the first session's turn had cached, and this turn wrote it again.
        assert 0 < missed <= main.buckets.cache_write_5m_tokens + main.buckets.cache_write_1h_tokens
        assert main.buckets.cache_read_input_tokens > 0
        out = subprocess.run(
            [*ADMIN, "--db", stack.db_url, "sessions", main.session_id, "--org", DEMO_ORG, "--csv"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert f"system_changed; {missed} tokens $" in out.stdout
    finally:
        stack.stop()
