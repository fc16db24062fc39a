"""The scheduler over a device pool with a host tier: demote, promote, fail safely."""

from __future__ import annotations

import asyncio

import pytest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.kvcore import BlockStored, Tier
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.errors import EngineFailedError
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.metrics import ReplicaMetrics
from cachepoint.replica.settings import ReplicaSettings

from .conftest import RecordingSink

LEN = 256  # max_model_len
BLOCKS = 20  # device blocks of 16 tokens: one long prompt plus a little
HOST = 64  # host slots


def _engine(host_slots: int) -> Engine:
    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    return Engine(
        cfg,
        EngineConfig(
            kv_cache_bytes=BLOCKS * per_block, max_model_len=LEN, host_kv_slots=host_slots
        ),
        seed=5,
    )


@pytest.fixture(scope="module")
def tiered() -> Engine:
    return _engine(HOST)


def _prompt(tag: int, n: int = 200) -> list[int]:
    return [(tag * 7919 + i * 31) % 250 + 3 for i in range(n)]


async def _run(s: TorchCore, tokens: list[int], max_tokens: int = 4):
    seq = s.submit(GenerateRequest(token_ids=tokens, max_tokens=max_tokens, temperature=0.0))
    await asyncio.wait_for(seq.done, 60)
    return seq


async def test_an_evicted_prefix_comes_back_from_the_host_tier_and_decodes_the_same(
    tiered: Engine,
) -> None:
    sink = RecordingSink()
    s = TorchCore(tiered, ReplicaSettings(name="r-tier"), sink=sink)
    assert s.pool.lower is not None and s.pool.lower.tier is Tier.HOST
    s.start()
    try:
        first = await _run(s, _prompt(1))
        await _run(s, _prompt(2))  # the device holds one prompt: the first is demoted
        again = await _run(s, _prompt(1))
    finally:
        await s.stop()
    s.pool.check_invariants()
    assert first.cache is not None and again.cache is not None
    assert first.cache.engine_hit_tokens == 0
    # 200 tokens: 12 full blocks, all usable (the last token is in the 13th).
    assert again.cache.engine_hit_tokens == 192
    # The device kept the blocks the second prompt did not need; the rest came up.
    assert 0 < again.cache.promoted_tokens < 192
    # Reuse through the host tier equals the recompute.
    assert again.output == first.output
    host = s.cache_stats().tiers[0]
    promoted = again.cache.promoted_tokens // 16
    assert host.tier is Tier.HOST and host.hits == promoted and host.promotions == promoted
    assert host.demotions >= promoted
    stored = [e for e in sink.events if isinstance(e, BlockStored) and e.tier is Tier.HOST]
    assert sum(len(e.block_hashes) for e in stored) == host.demotions
    assert s.copied_blocks >= 2 * promoted and s.copy_s > 0


async def test_a_failed_promotion_fails_that_request_and_publishes_nothing(
    tiered: Engine,
) -> None:
    s = TorchCore(tiered, ReplicaSettings(name="r-tier-fault"), sink=RecordingSink())
    s.start()
    try:
        await _run(s, _prompt(3))
        await _run(s, _prompt(4))

        def boom(position: int) -> None:
            raise RuntimeError("injected copy fault")

        tiered.copy_fault_hook = boom
        try:
            seq = s.submit(GenerateRequest(token_ids=_prompt(3), max_tokens=4))
            with pytest.raises(EngineFailedError, match="tier copy failed"):
                await asyncio.wait_for(seq.done, 60)
        finally:
            tiered.copy_fault_hook = None
        s.pool.check_invariants()
        # Nothing half-copied became visible on the device; the host still serves it.
        again = await _run(s, _prompt(3))
    finally:
        await s.stop()
    assert again.cache is not None and again.cache.promoted_tokens > 0
    s.pool.check_invariants()


def test_stats_and_metrics_report_each_tier(tiered: Engine) -> None:
    s = TorchCore(tiered, ReplicaSettings(name="r-tier-metrics"), sink=RecordingSink())
    from prometheus_client import generate_latest

    metrics = ReplicaMetrics(s)
    text = generate_latest(metrics.registry).decode()
    assert (
        'cachepoint_kv_tier_blocks{replica="r-tier-metrics",state="capacity",tier="host"} 64.0'
        in text
    )
    assert "cachepoint_kv_tier_promoted_bytes_total" in text
    assert s.block_bytes == tiered.kv_block_bytes


def test_no_host_tier_means_no_lower_store(small_engine: Engine) -> None:
    s = TorchCore(small_engine, ReplicaSettings(name="r-flat"), sink=RecordingSink())
    assert s.pool.lower is None and s.cache_stats().tiers == ()


class _Msg:
    """Just enough of a NATS message for the snapshot handler."""

    def __init__(self) -> None:
        self.data: bytes | None = None

    async def respond(self, data: bytes) -> None:
        self.data = data


async def test_heartbeats_report_measured_speeds_and_snapshots_list_each_tier(
    tiered: Engine,
) -> None:
    from cachepoint.events import schema
    from cachepoint.replica.bus import NatsBus

    s = TorchCore(tiered, ReplicaSettings(name="r-tier-bus"), sink=RecordingSink())
    bus = NatsBus(s, "nats://127.0.0.1:1", "http://r")
    before = bus.heartbeat()
    assert before.prefill_tokens_per_s == 0 and before.host_read_bytes_per_s == 0
    assert before.kv_bytes_per_token == tiered.kv_block_bytes // tiered.block_size
    s.start()
    try:
        await _run(s, _prompt(5))
        await _run(s, _prompt(6))  # demotes part of the first prompt to the host
        await _run(s, _prompt(5))  # promotes it back
    finally:
        await s.stop()
    hb = bus.heartbeat()
    assert hb.prefill_tokens_per_s > 0 and hb.host_read_bytes_per_s > 0
    assert hb.disk_read_bytes_per_s == 0  # no disk tier, nothing measured
    msg = _Msg()
    await bus._on_snapshot(msg)  # type: ignore[arg-type]
    assert msg.data is not None
    snap = schema.decode(msg.data, schema.Snapshot)
    host = s.pool.lower
    assert host is not None
    assert sorted(snap.host_hashes) == sorted(host.visible_hashes()) and snap.host_hashes
    assert not set(snap.host_hashes) & set(snap.block_hashes)


def test_build_engine_sizes_the_tiers_and_makes_the_disk_directory(tmp_path) -> None:
    from cachepoint.replica.api.app import build_engine

    where = tmp_path / "nvme" / "kv"
    settings = ReplicaSettings(
        name="r-build",
        kv_cache_bytes="8MiB",
        kv_host_bytes="4MiB",
        kv_disk_path=str(where),
        kv_disk_bytes="8MiB",
    )
    engine = build_engine(settings)
    try:
        assert where.is_dir()
        assert engine.host_kv_slots == 4 * 2**20 // engine.kv_block_bytes > 0
        assert engine.disk_kv_slots == 8 * 2**20 // engine.kv_block_bytes > 0
    finally:
        engine.close()


def test_a_tier_smaller_than_one_block_is_a_clear_error() -> None:
    from cachepoint.replica.api.app import build_engine

    with pytest.raises(ValueError, match="kv_host_bytes=1000 holds no whole KV block"):
        build_engine(ReplicaSettings(name="r-small", kv_cache_bytes="8MiB", kv_host_bytes=1000))


async def test_a_preempted_sequence_comes_back_from_its_published_progress(
    tiered: Engine,
) -> None:
    # 20 device blocks; two sequences of 40 + 200 tokens need 30: the newer one is
    # preempted. Its computed blocks (prompt and output) are published as it leaves,
    # pushed to the host tier by the other's growth, and promoted back at readmission:
    # a swap, not a recompute of its whole context.
    kw = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
    s = TorchCore(
        tiered, ReplicaSettings(name="r-swap", max_num_batched_tokens=256), sink=RecordingSink()
    )
    s.start()
    try:
        alone = await _run(s, _prompt(7, 40), max_tokens=200)
        s.manager.clear()
        a = s.submit(GenerateRequest(token_ids=_prompt(8, 40), **kw))
        b = s.submit(GenerateRequest(token_ids=_prompt(7, 40), **kw))
        await asyncio.wait_for(asyncio.gather(a.done, b.done), 120)
    finally:
        await s.stop()
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert b.output == alone.output  # the same tokens as without the preemption
    # Only b's readmission can have hit (both prompts were new): far more than its
    # prompt's two full blocks, i.e. its output's blocks came back.
    assert s.cache_stats().hit_tokens > 40 + 64
    host = s.cache_stats().tiers[0]
    assert host.promotions > 0
    # A readmission that has to wait checks first: it never starts promotions (copies,
    # hits) that it would hand back at once.
    assert host.hits == host.promotions
    s.pool.check_invariants()


async def test_a_readmission_that_must_wait_starts_no_promotions() -> None:
    # Eight sequences that together need far more than the pool (bench/preempt_bench.py
    # in small): preempted ones wait for headroom while others run. Waiting must not
    # queue promotion copies (and count hits) for blocks it would hand straight back.
    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    engine = Engine(
        cfg,
        EngineConfig(kv_cache_bytes=98 * per_block, max_model_len=LEN, host_kv_slots=256),
        seed=5,
    )
    kw = {"max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
    s = TorchCore(
        engine, ReplicaSettings(name="r-wait", max_num_batched_tokens=2048), sink=RecordingSink()
    )
    s.start()
    try:
        seqs = [s.submit(GenerateRequest(token_ids=_prompt(20 + i, 40), **kw)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(q.done for q in seqs)), 120)
    finally:
        await s.stop()
        engine.close()
    assert s.preemptions > 0
    host = s.cache_stats().tiers[0]
    assert host.promotions > 0 and host.hits == host.promotions
    s.pool.check_invariants()


async def test_a_promotion_is_traced_as_a_promote_span_inside_the_prefill(tiered: Engine) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    s = TorchCore(tiered, ReplicaSettings(name="r-tier-trace"), sink=RecordingSink())
    s.tracer = provider.get_tracer("test")
    s.start()
    try:
        await _run(s, _prompt(11))
        await _run(s, _prompt(12))
        again = await _run(s, _prompt(11))
    finally:
        await s.stop()
    spans = exporter.get_finished_spans()
    promotes = [sp for sp in spans if sp.name == "promote"]
    assert len(promotes) == 1
    promote = promotes[0]
    prefill = next(
        sp for sp in spans if sp.name == "prefill" and sp.context.span_id == promote.parent.span_id
    )
    assert prefill.start_time <= promote.start_time <= promote.end_time <= prefill.end_time
    assert again.cache is not None
    blocks = again.cache.promoted_tokens // 16
    assert promote.attributes["cachepoint.promote.host_blocks"] == blocks
    assert promote.attributes["cachepoint.promote.bytes"] == blocks * s.block_bytes


@pytest.mark.parametrize("decode_steps", [1, 16])
async def test_blocks_evicted_for_a_run_of_decode_steps_are_demoted_before_overwritten(
    tiered: Engine, decode_steps: int
) -> None:
    """A long decode whose runs of steps need blocks evicts a cached prompt's blocks:
    their demotions are copied before those blocks take the decode's K/V, so the
    prompt, back from the host tier, decodes as it did the first time."""
    s = TorchCore(
        tiered,
        ReplicaSettings(name="r-tier-multi", decode_steps=decode_steps),
        sink=RecordingSink(),
    )
    s.multi_step_budget_s = 60.0  # whole runs however slow the machine
    s.start()
    try:
        first = await _run(s, _prompt(5), max_tokens=8)
        grower = s.submit(
            GenerateRequest(token_ids=_prompt(6, 20), max_tokens=200, ignore_eos=True)
        )
        await asyncio.wait_for(grower.done, 60)
        again = await _run(s, _prompt(5), max_tokens=8)
    finally:
        await s.stop()
    s.pool.check_invariants()
    assert again.cache is not None and again.cache.promoted_tokens > 0
    assert again.output == first.output
