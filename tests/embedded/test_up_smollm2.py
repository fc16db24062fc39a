"""`cachepoint up --model smollm2`: the real model behind the whole stack, as a user runs it."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import anthropic
import pytest

from cachepoint.embedded.stack import Stack, StackError
from cachepoint.embedded.up import min_cacheable
from cachepoint.gateway.contract.render import Renderer

from .test_up import CMD, _alive, _wait_for_endpoint

MODEL_ID = "smollm2-135m-instruct"


@pytest.mark.slow
def test_up_model_smollm2_answers_through_the_sdk(tmp_path, free_port):
    port = free_port()
    state = tmp_path / "state"
    flags = ["--model", "smollm2", "--replicas", "1", "--state-dir", str(state)]
    proc = subprocess.Popen(
        [*CMD, *flags, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_endpoint(proc, state)
        ep = json.loads((state / "endpoint.json").read_text())
        client = anthropic.Anthropic(base_url=ep["base_url"], api_key=ep["api_key"])
        assert MODEL_ID in [m.id for m in client.models.list().data]
        question = "What is the capital of France?"
        msg = client.messages.create(
            model=MODEL_ID,
            max_tokens=16,
            # NOTE: this SDK's create() has no temperature keyword; the API does.
            extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": question}],
        )
        text = "".join(b.text for b in msg.content if b.type == "text")
        # A real answer from the real weights (greedy), not the random model's noise.
        assert "Paris" in text, text
        assert msg.model == MODEL_ID
        # Counted in the model's BPE tokens (about 4 bytes each), not in bytes: the
        # question alone is 30 bytes but 7 tokens.
        assert 7 <= msg.usage.input_tokens < 60, msg.usage
        _tool_round_trip(client)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "smollm2-135m-instruct" in out and "Traceback" not in out, out
    time.sleep(0.5)
    assert not [n for n, pid in ep["pids"].items() if _alive(pid)], "orphan processes left"


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "the city name"}},
        "required": ["city"],
    },
}


def _tool_round_trip(client: anthropic.Anthropic) -> None:
    """The real model calls a tool through the template, then reads its result."""
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kw = {"model": MODEL_ID, "max_tokens": 48, "extra_body": {"temperature": 0.0}}
    call = client.messages.create(
        **kw,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask,
    )
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use", call
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})], call
    assert uses[0].id.startswith("toolu_")
    result = "18 degrees Celsius and sunny"
    follow = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in call.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}],
        },
    ]
    # NOTE: tool_choice none, as a client does when it wants the answer now: with the
    # tool still on offer the 135M model writes a <tool_response> of its own instead.
    answer = client.messages.create(
        **kw, tools=[WEATHER_TOOL], tool_choice={"type": "none"}, messages=follow
    )
    text = "".join(b.text for b in answer.content if b.type == "text")
    # The model read the rendered tool result: it answers with its figure.
    assert answer.stop_reason in ("end_turn", "max_tokens") and "18" in text, answer


def test_up_help_names_the_model_flag():
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--model " in out and "smollm2" in out


def test_up_refuses_model_with_model_dir(tmp_path):
    r = subprocess.run(
        [*CMD, "--state-dir", str(tmp_path), "--model", "smollm2", "--model-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "give --model or --model-dir, not both" in r.stderr
    r = subprocess.run([*CMD, "--model", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


def test_stack_serves_the_checkpoints_own_id(tmp_path):
    tiny = Stack(state_dir=tmp_path)
    assert tiny.checkpoint() is None and tiny.served_model() == "cachepoint-tiny"
    smol = Stack(state_dir=tmp_path, model="smollm2")
    path = smol.checkpoint()
    assert path is not None and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.served_model() == MODEL_ID
    with pytest.raises(StackError, match="not both"):
        Stack(state_dir=tmp_path, model="smollm2", model_dir=tmp_path).checkpoint()


def test_stack_refuses_a_model_dir_that_is_no_checkpoint(tmp_path):
    with pytest.raises(StackError, match=r"has no config\.json"):
        Stack(state_dir=tmp_path / "s", model_dir=tmp_path, port=0).start()


def test_min_cacheable_defaults_per_model():
    def ns(**kw: object) -> argparse.Namespace:
        given = {"min_cacheable_tokens": None, "model": None, "model_dir": None}
        return argparse.Namespace(**{**given, "tokenizer": "smollm2", **kw})

    # 1024 for byte tokens; 256 for a real tokenizer's (the tiny model's default BPE,
    # or a checkpoint's), whose tokens are about 4 bytes each.
    assert min_cacheable(ns(tokenizer="bytes")) == 1024
    assert min_cacheable(ns()) == 256
    assert min_cacheable(ns(model="smollm2")) == 256
    assert min_cacheable(ns(min_cacheable_tokens=64, model="smollm2")) == 64


def test_demo_session_fits_smollm2_context_and_caches_its_system_prompt():
    """Twelve turns fit the model's 8,192 positions, and the static system prompt is
    long enough in its tokens to be cached at the --model floor (256)."""
    from cachepoint.embedded.demo_session import (
        MAX_TOKENS,
        STATIC_SYSTEM,
        TOOLS,
        assistant_turn,
        next_request,
        system_blocks,
    )
    from cachepoint.gateway.schemas.messages import MessagesRequest
    from cachepoint.replica.model_source import preset_path
    from cachepoint.tokenizer import load_tokenizer

    tok = load_tokenizer(preset_path("smollm2"))
    assert len(tok.encode(STATIC_SYSTEM)) >= 256
    renderer = Renderer(tok)
    messages: list[dict] = []
    tool_id = None
    reply = "word " * MAX_TOKENS
    for turn in range(1, 13):
        next_request(messages, turn, tool_id)
        req = MessagesRequest.model_validate(
            {
                "model": MODEL_ID,
                "max_tokens": MAX_TOKENS,
                "tools": TOOLS,
                "system": system_blocks(),
                "messages": messages,
            }
        )
        n = len(renderer.render(req))
        assert n + MAX_TOKENS <= 8192, f"turn {turn}: {n} prompt tokens"
        msg, tool_id = assistant_turn(turn, reply)
        messages.append(msg)
    assert n < 4000  # about 4 bytes a token: far inside the context


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
