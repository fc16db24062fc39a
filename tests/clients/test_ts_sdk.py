"""The TypeScript SDK (@anthropic-ai/sdk 1.10.0 from npm) against the gateway:
create, stream, countTokens and typed errors, beside the Python SDK's tests. A scripted
replica answers, so the token texts and counts are exact."""

from __future__ import annotations

import json
import shutil
import subprocess

from ..gateway.scripted import MODEL, Script, gateway_factory
from .harness import NODE_MODULES, TS_CHECK, TS_SDK, installed

TEXTS = ["Hi", " there", "!"]


def test_ts_sdk_create_stream_count_and_error(serve, tmp_path) -> None:
    installed(TS_SDK)
    node = shutil.which("node")
    assert node, "node is not on PATH (Node.js 20 is a requirement of `make test`)"
    script = Script(texts=TEXTS, once=True, stop_reason="end_turn")
    gw = gateway_factory(serve, tmp_path)(script)
    env = {
        "PATH": "",
        "CACHEPOINT_BASE_URL": gw.url,
        "CACHEPOINT_API_KEY": gw.keys["a"],
        "CACHEPOINT_MODEL": MODEL,
        "CACHEPOINT_NODE_MODULES": str(NODE_MODULES),
    }
    r = subprocess.run([node, str(TS_CHECK)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["sdk_version"] == "1.10.0"

    created = out["create"]
    assert (created["type"], created["role"], created["model"]) == ("message", "assistant", MODEL)
    assert created["text"] == "Hi there!" and created["stop_reason"] == "end_turn"
    assert created["usage"]["output_tokens"] == len(TEXTS)

    streamed = out["stream"]
    assert streamed["text"] == "Hi there!" and streamed["stop_reason"] == "end_turn"
    assert streamed["events"][0] == "message_start" and streamed["events"][-1] == "message_stop"
    assert streamed["events"].count("content_block_delta") == len(TEXTS)
    # The stream and the plain answer bill the same prompt.
    prompt = {k: created["usage"][k] for k in ("input_tokens", "cache_read_input_tokens")}
    assert {k: streamed["usage"][k] for k in prompt} == prompt

    # count_tokens counts the same prompt create billed (nothing cached: all input).
    u = created["usage"]
    billed = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    assert out["count_tokens"] == {"input_tokens": billed}

    err = out["not_found"]
    assert err["class"] == "NotFoundError" and err["not_found"] and not err["bad_request"]
    assert (err["status"], err["type"]) == (404, "not_found_error")
    assert "no-such-model" in err["message"] and err["request_id"].startswith("req_")
    err = out["bad_request"]
    assert err["class"] == "BadRequestError" and err["bad_request"]
    assert (err["status"], err["type"]) == (400, "invalid_request_error")
    assert "max_tokens" in err["message"]

    assert len(gw.wait_rows(2)) == 2  # create and stream billed; count_tokens is free
