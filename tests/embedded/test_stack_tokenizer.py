"""The embedded stack's tiny model speaks SmolLM2's BPE by default: the
replicas and the gateway share the tokenizer, prompts count in real tokens, and the
context is the random model's 262,144 positions, not the byte era's 8,192."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from cachepoint.embedded.stack import Stack, StackError
from cachepoint.gateway.contract.template import build_renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.replica.model_source import preset_path
from cachepoint.replica.random_model import RANDOM_CONTEXT

from ..replica.test_random_tokenizer import long_text
from .test_up import CMD

SMOLLM2 = preset_path("smollm2")


def _args(stack: Stack, name: str) -> list[str]:
    return next(c.args for c in stack.children if c.name == name)


def _ask(stack: Stack, text: str) -> tuple[MessagesRequest, dict]:
    body = {
        "model": "cachepoint-tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": text}],
    }
    r = httpx.post(
        f"{stack.base_url}/v1/messages",
        headers={"x-api-key": stack.keys["api_key"]},
        json=body,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return MessagesRequest.model_validate(body), r.json()["usage"]


def _prompt_tokens(usage: dict) -> int:
    return (
        usage["input_tokens"]
        + usage["cache_creation_input_tokens"]
        + usage["cache_read_input_tokens"]
    )


def test_stack_tokenizer_choices(tmp_path: Path) -> None:
    assert Stack(tmp_path).random_tokenizer() == SMOLLM2  # the default
    assert Stack(tmp_path, tokenizer="bytes").random_tokenizer() is None
    # A checkpoint brings its own tokenizer; the option is the random model's only.
    assert Stack(tmp_path, model="smollm2").random_tokenizer() is None
    with pytest.raises(StackError, match=r"tokenizer 'nope' is none of bytes, smollm2"):
        Stack(tmp_path, tokenizer="nope").random_tokenizer()


def test_up_tokenizer_flag_is_documented_and_checked(tmp_path: Path) -> None:
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--tokenizer" in out and "default smollm2" in out and "262,144" in out
    r = subprocess.run(
        [*CMD, "--state-dir", str(tmp_path), "--model", "smollm2", "--tokenizer", "bytes"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "--model and --model-dir bring their own" in r.stderr


@pytest.mark.slow
def test_stack_default_counts_smollm2_tokens_past_8192(default_stack: Stack) -> None:
    stack = default_stack

    def stats() -> dict:
        return httpx.get(
            f"{stack.children[1].url}/v1/stats",
            headers={"authorization": f"Bearer {stack.credentials.internal_token}"},
        ).json()

    replica, gateway = _args(stack, "replica-0"), _args(stack, "gateway")
    assert replica[replica.index("--tokenizer") + 1] == str(SMOLLM2)
    assert gateway[gateway.index("--model-dir") + 1] == str(SMOLLM2)
    assert "--kv-budget" not in replica  # the replica's 256 MiB: the full context
    before = stats()["query_tokens"]  # the stack is shared: count this test's call only
    text = long_text(4000)  # 33,579 bytes; 11,610 tokens as SmolLM2 renders it
    req, usage = _ask(stack, text)
    # The gateway's count is SmolLM2's ChatML rendering, token for token.
    want = len(build_renderer(SMOLLM2).render(req))
    assert _prompt_tokens(usage) == want
    assert 8192 < want < len(text.encode()) // 2
    after = stats()
    assert after["query_tokens"] - before == want  # the replica saw the same ids
    assert after["max_model_len"] == RANDOM_CONTEXT


@pytest.mark.slow
def test_stack_bytes_tokenizer_counts_bytes(tmp_path: Path, free_port) -> None:
    stack = Stack(
        tmp_path / "state", replicas=1, port=free_port(), tracing=False, tokenizer="bytes"
    )
    stack.start()
    try:
        assert _args(stack, "replica-0")[-2:] == ["--tokenizer", "bytes"]
        assert "--model-dir" not in _args(stack, "gateway")
        text = "x" * 9000  # past the old 8,192-token window, in bytes
        req, usage = _ask(stack, text)
        assert _prompt_tokens(usage) == len(build_renderer(None).render(req)) > 9000
    finally:
        stack.stop()
