"""The random model's tokenizer option and long context: the tiny replica
speaks SmolLM2's BPE ids, takes prompts of tens of thousands of real tokens, and the
byte tokenizer stays available."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from cachepoint.replica.api.app import create_app
from cachepoint.replica.model_source import preset_path
from cachepoint.replica.random_model import RANDOM_CONTEXT, random_context
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.tokenizer import BYTE_VOCAB_SIZE, load_tokenizer

CMD = [sys.executable, "-m", "cachepoint.replica.cli"]
SMOLLM2 = preset_path("smollm2")


def long_text(words: int) -> str:
    """Varied English-like prose: BPE merges it into a few bytes per token."""
    vocab = [
        "cache",
        "prefix",
        "token",
        "replica",
        "gateway",
        "block",
        "model",
        "prompt",
        "agent",
        "tool",
    ]
    return " ".join(f"{vocab[i % len(vocab)]}{i % 97}" for i in range(words))


def test_tokenizer_setting_resolves_names_and_paths(tmp_path: Path) -> None:
    assert ReplicaSettings().tokenizer == "bytes" and ReplicaSettings().tokenizer_path is None
    assert ReplicaSettings(tokenizer="smollm2").tokenizer_path == SMOLLM2
    assert ReplicaSettings(tokenizer=str(SMOLLM2)).tokenizer_path == SMOLLM2
    (tmp_path / "tokenizer.json").write_text("{}")
    assert ReplicaSettings(tokenizer=str(tmp_path)).tokenizer_path == tmp_path


def test_bad_tokenizer_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"is none of bytes, smollm2, a \.gguf file"):
        ReplicaSettings(tokenizer="gpt5")
    with pytest.raises(ValidationError, match=r"missing\.gguf is not a file"):
        ReplicaSettings(tokenizer=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValidationError, match=r"has no tokenizer\.json"):
        ReplicaSettings(tokenizer=str(tmp_path))
    with pytest.raises(ValidationError, match=r"random model only"):
        ReplicaSettings(model="smollm2", tokenizer="smollm2")


def test_random_context_shrinks_to_what_the_budget_holds() -> None:
    # The tiny model: 2 layers x 2 KV heads x 16 dims x K and V x float32 = 512 B/token.
    assert random_context(RANDOM_CONTEXT, 512, 256 * 2**20, 16) == RANDOM_CONTEXT
    assert random_context(RANDOM_CONTEXT, 512, 128 * 2**20, 16) == RANDOM_CONTEXT
    assert random_context(RANDOM_CONTEXT, 512, 16 * 2**20, 16) == 32768
    assert random_context(RANDOM_CONTEXT, 512, 16 * 2**20 + 100, 16) == 32768  # whole blocks


def test_bpe_tiny_replica_serves_a_20k_token_prompt(serve) -> None:
    tok = load_tokenizer(SMOLLM2)
    text = long_text(7000)
    ids = tok.encode(text)
    # Real BPE tokens: well past the old 8,192 positions, and far fewer than the bytes.
    assert 20_000 <= len(ids) < len(text.encode()) // 2
    settings = ReplicaSettings(
        name="r-bpe", tokenizer="smollm2", device="cpu", max_num_batched_tokens=4096
    )
    app = create_app(settings)
    url = serve(app)
    engine = app.state.scheduler.engine
    assert engine.vocab_size == 49_152 == tok.vocab_size
    assert engine.tokenizer.encode(text) == ids
    assert engine.eos_ids == {tok.eos_id} == {2}  # not the byte tokenizer's 257
    assert engine.max_model_len == RANDOM_CONTEXT
    # The default 256 MiB budget: the pool is the budget, not sized by the context.
    assert engine.kv_pool_bytes == 256 * 2**20
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/v1/generate",
        json={"token_ids": ids, "max_tokens": 2, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["output_tokens"] == 2
    assert all(0 <= t < 49_152 for t in r.json()["output_token_ids"])
    assert time.monotonic() - t0 < 60
    stats = httpx.get(f"{url}/v1/stats").json()
    assert stats["query_tokens"] == len(ids)
    assert stats["max_model_len"] == RANDOM_CONTEXT
    # The whole vocabulary is servable, and nothing past it.
    top = httpx.post(f"{url}/v1/generate", json={"token_ids": [1, 49_151], "max_tokens": 1})
    assert top.status_code == 200, top.text
    past = httpx.post(f"{url}/v1/generate", json={"token_ids": [1, 49_152], "max_tokens": 1})
    assert past.status_code == 400 and "(0..49151)" in past.text


def test_byte_tokenizer_still_works_with_the_long_context(serve) -> None:
    settings = ReplicaSettings(name="r-bytes", device="cpu", kv_cache_bytes=16 * 2**20)
    app = create_app(settings)
    url = serve(app)
    engine = app.state.scheduler.engine
    assert engine.vocab_size == BYTE_VOCAB_SIZE
    assert engine.eos_ids == {257}
    # A 16 MiB budget holds 32,768 of the tiny model's tokens: the context shrinks to
    # that instead of refusing to start.
    assert engine.max_model_len == 32_768
    prompt = list(b"x" * 9000)  # past the old 8,192 positions
    r = httpx.post(f"{url}/v1/generate", json={"token_ids": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    past = httpx.post(f"{url}/v1/generate", json={"token_ids": [300], "max_tokens": 1})
    assert past.status_code == 400 and f"(0..{BYTE_VOCAB_SIZE - 1})" in past.text


def test_cli_explains_and_checks_the_tokenizer_flag(tmp_path: Path) -> None:
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--tokenizer" in out and "262,144 positions" in out and "49,152 ids" in out
    bad = [
        (["--tokenizer", str(tmp_path / "nope")], "is none of bytes, smollm2"),
        (["--model", "smollm2", "--tokenizer", "smollm2"], "random model only"),
    ]
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    bad.append((["--tokenizer", str(broken)], f"--tokenizer {broken}: "))
    for flags, message in bad:
        r = subprocess.run([*CMD, *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (flags, r.stderr)
        assert message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_cli_replica_with_bpe_tokenizer_logs_its_vocab(free_port) -> None:
    from .conftest import wait_ready

    port = free_port()
    proc = subprocess.Popen(
        [*CMD, "--port", str(port), "--tokenizer", "smollm2", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=120)
        stats = httpx.get(f"{url}/v1/stats").json()
        assert stats["model"] == "cachepoint-tiny" and stats["max_model_len"] == RANDOM_CONTEXT
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    started = next(line for line in out.splitlines() if '"replica_started"' in line)
    assert '"vocab_size":49152' in started and '"tokenizer":"smollm2"' in started


def test_random_turn_tokens_end_the_random_models_turn(serve, tmp_path: Path) -> None:
    """Random weights never end a turn; with random_turn_tokens N their N-th token is
    EOS (stop_reason end_turn), streamed and not; ignore_eos still runs to max_tokens."""
    settings = ReplicaSettings(
        name="r-turn", device="cpu", kv_cache_bytes=16 * 2**20, random_turn_tokens=5
    )
    url = serve(create_app(settings))
    body = {"token_ids": list(b"hello there"), "max_tokens": 50}
    out = httpx.post(f"{url}/v1/generate", json=body).json()
    assert out["stop_reason"] == "end_turn" and out["output_tokens"] == 5
    assert out["output_token_ids"][-1] == 257  # the byte tokenizer's EOS
    with httpx.stream("POST", f"{url}/v1/generate", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    done = [ln for ln in lines if '"type": "done"' in ln or '"type":"done"' in ln]
    assert len(done) == 1 and '"end_turn"' in done[0]
    assert sum('"type": "token"' in ln or '"type":"token"' in ln for ln in lines) == 5
    shorter = httpx.post(f"{url}/v1/generate", json={**body, "max_tokens": 3}).json()
    assert shorter["stop_reason"] == "max_tokens" and shorter["output_tokens"] == 3
    free = httpx.post(f"{url}/v1/generate", json={**body, "ignore_eos": True}).json()
    assert free["stop_reason"] == "max_tokens" and free["output_tokens"] == 50
    # A checkpoint ends its own turns: the option is refused with one.
    with pytest.raises(ValidationError, match="random model only"):
        ReplicaSettings(model_dir=str(SMOLLM2), random_turn_tokens=5)
