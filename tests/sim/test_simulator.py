"""The replay on real kvcore pools: hand-computed hits, eviction, routing, events, seeds."""

from __future__ import annotations

import pytest

from cachepoint.sim.bound import infinite_cache_bound
from cachepoint.sim.content import TraceHasher
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator, run_simulation

from .conftest import tiny_trace


def req(t: float, ids: list[int], length: int, out: int = 0, **extra: object) -> dict[str, object]:
    return {
        "timestamp": t * 1000,
        "input_length": length,
        "output_length": out,
        "hash_ids": ids,
        **extra,
    }


# Four requests, 100 s apart so each finishes before the next arrives.
#   r0 [1,2,3] 12 tokens: cold.
#   r1 [1,2,4] 12 tokens: blocks 1,2 cached; its last block holds the last token anyway.
#   r2 [1,2,3,5] 14 tokens: blocks 1,2,3 cached (the partial block 5 is never hashed).
#   r3 [1,2,4] 12 tokens: blocks 1,2 again; 4 was cached by r1 but is the last block.
FOUR = [
    req(0, [1, 2, 3], 12),
    req(100, [1, 2, 4], 12),
    req(200, [1, 2, 3, 5], 14),
    req(300, [1, 2, 4], 12),
]


def _run(requests: list[dict[str, object]], **config: object):
    return run_simulation(tiny_trace(requests), SimConfig(**config))  # type: ignore[arg-type]


def test_bound_is_computed_from_the_trace_alone():
    trace = tiny_trace(FOUR)
    bound = infinite_cache_bound(trace, TraceHasher(4, 4).prepare_all(trace))
    # seen before: r1 {1,2}, r2 {1,2,3}, r3 {1,2,4} = 8 of 3+3+4+3 = 13 blocks
    assert (bound.blocks, bound.blocks_seen, bound.distinct_blocks) == (13, 8, 5)
    assert bound.tokens == 50
    assert bound.tokens_seen == 32


def test_one_big_replica_hits_hand_computed_counts():
    r = _run(FOUR, replicas=1, capacity_blocks=64)
    # hits in 4-token blocks: r1 2, r2 3, r3 2 (r3's block 4 holds its last token)
    assert r.hit_ratio == pytest.approx(7 / 13)
    assert r.token_hit_ratio == pytest.approx(28 / 50)
    assert r.bound == pytest.approx(8 / 13)
    assert r.ratio_to_bound == pytest.approx(7 / 8)
    assert r.per_replica[0].cached_tokens == 28
    assert r.per_replica[0].prefill_tokens == 50 - 28
    assert r.rejected == 0


def test_lru_eviction_in_a_four_block_pool_hand_computed():
    requests = [
        req(0, [1, 2, 3], 12),  # fills 3 blocks; free queue: [empty, 3, 2, 1]
        req(100, [1, 2, 4], 12),  # hits 1,2; takes the empty block for 4: queue [3, 4, 2, 1]
        req(200, [1, 2, 3, 5], 16),  # hits 1,2,3 (3 is still cached); evicts 4
        req(300, [1, 2, 4, 6], 16),  # hits 1,2 only: 4 was evicted
    ]
    r = _run(requests, replicas=1, capacity_blocks=4, eviction="lru")
    assert r.per_replica[0].cached_tokens == 4 * (2 + 3 + 2)
    assert r.evictions >= 1


def test_round_robin_and_cache_aware_route_the_same_trace_differently():
    spread = _run(FOUR, replicas=2, capacity_blocks=64, policy="round_robin")
    # r0,r2 -> replica 0; r1,r3 -> replica 1: r2 hits 1,2,3; r3 hits 1,2 (r1's blocks)
    assert spread.per_replica[0].cached_tokens == 12
    assert spread.per_replica[1].cached_tokens == 8
    aware = _run(FOUR, replicas=2, capacity_blocks=64, policy="cache_aware")
    assert sum(s.cached_tokens for s in aware.per_replica) == 28
    assert sorted(s.requests for s in aware.per_replica) == [0, 4]


def test_events_reach_the_router_index_exactly(sessions):
    prepared = PreparedTrace.build(sessions)
    for delay in (0.0, 0.5):
        sim = Simulator(prepared, SimConfig(replicas=3, capacity_blocks=40, event_delay_s=delay))
        result = sim.run()
        assert result.events > 0
        for replica in sim.replicas:
            cached = replica.pool.cached
            assert len(replica.view.index) == len(cached)
            assert all(h in replica.view.index for h in cached)


def test_identical_seeds_give_identical_results(sessions):
    prepared = PreparedTrace.build(sessions)
    config = SimConfig(replicas=4, capacity_blocks=30, policy="cache_aware", seed=7)

    def strip(d: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in d.items() if k not in ("elapsed_s", "prepare_s")}

    a = strip(Simulator(prepared, config).run().to_json(full=True))
    b = strip(Simulator(prepared, config).run().to_json(full=True))
    assert a == b
    others = [
        strip(
            Simulator(prepared, SimConfig(replicas=4, capacity_blocks=30, seed=s))
            .run()
            .to_json(full=True)
        )
        for s in (8, 9, 10)
    ]
    assert any(o["per_replica"] != a["per_replica"] for o in others)


def test_whole_prompt_retention_bills_writes_then_reads_until_the_ttl_expires():
    base = [
        req(0, [1, 2, 3], 12, 10),
        req(100, [1, 2, 3, 4], 16, 10),
        req(1000, [1, 2, 3, 4, 5], 20, 10),
    ]
    r = _run(base, replicas=1, capacity_blocks=64, retention="5m", min_cacheable_tokens=1)
    # r0 writes 12; r1 reads 12 (entry at 12), writes 4; r2 arrives after the 5m TTL: writes 20
    assert r.cache_read_input_tokens == 12
    assert r.cache_creation_input_tokens == 12 + 4 + 20
    assert r.input_tokens == 0
    long = _run(base, replicas=1, capacity_blocks=64, retention="1h", min_cacheable_tokens=1)
    assert long.cache_read_input_tokens == 12 + 16
    assert long.cache_creation_input_tokens == 12 + 4 + 4
    plain = _run(base, replicas=1, capacity_blocks=64, retention="none")
    assert plain.cost_saving == 0.0
    assert plain.input_tokens == 48


def test_prompts_below_the_minimum_cacheable_length_are_never_written():
    r = _run(FOUR, replicas=1, capacity_blocks=64, retention="5m", min_cacheable_tokens=13)
    assert r.cache_creation_input_tokens == 14  # only r2 (14 tokens) reaches the minimum
    assert r.cache_read_input_tokens == 0


def test_request_larger_than_the_pool_is_rejected_not_stuck():
    r = _run([req(0, [1, 2, 3, 4, 5], 20), req(1, [1, 2], 8)], replicas=1, capacity_blocks=3)
    assert r.rejected == 1
    assert r.per_replica[0].requests == 1


def test_time_scale_compresses_arrivals_and_builds_queues():
    many = [req(t * 0.001, [100 + t, 200 + t, 300 + t], 12, 50) for t in range(40)]
    slow = _run(many, replicas=1, capacity_blocks=400, time_scale=1000.0)
    fast = _run(many, replicas=1, capacity_blocks=400, time_scale=1.0)
    assert slow.queue_p90_s == 0.0
    assert fast.queue_p90_s > 0.0
    assert fast.ttft_p90_s > slow.ttft_p90_s


def test_oracle_eviction_is_never_worse_than_lru_on_sessions(sessions):
    prepared = PreparedTrace.build(sessions)
    lru = Simulator(prepared, SimConfig(replicas=2, capacity_blocks=24, eviction="lru")).run()
    oracle = Simulator(prepared, SimConfig(replicas=2, capacity_blocks=24, eviction="oracle")).run()
    assert oracle.hit_ratio >= lru.hit_ratio
    assert oracle.hit_ratio <= oracle.bound


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="replicas"):
        SimConfig(replicas=0)
    with pytest.raises(ValueError, match="retention"):
        SimConfig(retention="forever")
    with pytest.raises(ValueError, match="time_scale"):
        SimConfig(time_scale=0)
    with pytest.raises(ValueError, match="unknown eviction"):
        _run(FOUR, eviction="mru")
