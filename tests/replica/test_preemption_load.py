"""The preemption target, scaled down: 32 concurrent requests whose KV is ten times the
pool all complete, through the HTTP API, with preemptions counted and greedy output
unchanged by the recomputes."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.api.app import create_app
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings

REQUESTS = 32
PROMPT = 16
MAX_TOKENS = 144
MAX_LEN = 256
POOL_BLOCKS = REQUESTS * (PROMPT + MAX_TOKENS) // 16 // 10  # a tenth of the total: 32
WAIT_S = 60  # a deadlock fails the test instead of hanging it (it takes ~5 s)


def _engine(blocks: int) -> Engine:
    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    eng = Engine(
        cfg, EngineConfig(kv_cache_bytes=blocks * per_block, max_model_len=MAX_LEN), seed=3
    )
    assert eng.num_blocks == blocks
    return eng


def _body(i: int) -> dict[str, object]:
    rng = random.Random(i)
    return {
        "token_ids": [rng.randrange(256) for _ in range(PROMPT)],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }


async def _unpreempted() -> list[list[int]]:
    """The same requests on the same weights with a pool that holds them all."""
    s = TorchCore(_engine(REQUESTS * MAX_LEN // 16), ReplicaSettings(name="r-ref"))
    s.start()
    try:
        seqs = [s.submit(GenerateRequest(**_body(i))) for i in range(REQUESTS)]  # type: ignore[arg-type]
        await asyncio.wait_for(asyncio.gather(*(q.done for q in seqs)), WAIT_S)
    finally:
        await s.stop()
    assert s.preemptions == 0
    return [q.output for q in seqs]


@pytest.mark.timeout(120)
async def test_32_requests_ten_times_the_pool_all_complete(serve, sink) -> None:
    settings = ReplicaSettings(name="r-load", max_num_batched_tokens=256)
    url = serve(create_app(settings, _engine(POOL_BLOCKS), sink=sink))
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        replies = await asyncio.wait_for(
            asyncio.gather(*(client.post("/v1/generate", json=_body(i)) for i in range(REQUESTS))),
            WAIT_S,
        )
        stats = (await client.get("/v1/stats")).json()
        metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in replies] == [200] * REQUESTS, replies[0].text
    results = [r.json() for r in replies]
    assert all(r["output_tokens"] == MAX_TOKENS for r in results)
    assert all(r["stop_reason"] == "max_tokens" for r in results)
    preempted = sum(r["timings"]["preemptions"] for r in results)
    assert preempted > 0
    assert stats["preemptions"] == preempted
    assert (stats["running"], stats["waiting"], stats["blocks"]["active"]) == (0, 0, 0)
    counted = next(
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "cachepoint_replica_preemptions_total"
    )
    assert counted == preempted
    # Recompute preemption must not change a greedy sequence's tokens.
    assert [r["output_token_ids"] for r in results] == await _unpreempted()
