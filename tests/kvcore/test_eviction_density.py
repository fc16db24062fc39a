"""Hit-density eviction: the free-queue contract, LRU order before it learns, and what it learns."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.kvcore import (
    BlockHash,
    BlockPool,
    FreeBlockQueue,
    HitDensityEviction,
    HitDensityQueue,
    KVBlock,
    KVCacheManager,
    LRUEviction,
    ManualClock,
    ReuseCreditEviction,
)
from cachepoint.kvcore.eviction_density import (
    NUM_BUCKETS,
    ReuseHistogram,
    age_bucket,
    decreasing_rates,
)

from .helpers import BLOCK, apply_pool_op, prompt, serve

# (op, block index, hits or seconds): random traffic for a queue of up to 12 blocks.
QUEUE_OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "appendleft", "remove", "pop", "tick"]),
        st.integers(0, 11),
        st.integers(0, 4),
    ),
    max_size=120,
)


def _drive(queue, blocks: list[KVBlock], clock: ManualClock, ops) -> list[list[int]]:
    """Apply ops as the pool would (only legal moves); returns the ids each pop took."""
    popped: list[list[int]] = []
    for op, i, arg in ops:
        block = blocks[i % len(blocks)]
        queued = block.prev_free is not None
        if op == "append" and not queued:
            block.hits = arg
            block.block_hash = BlockHash(i.to_bytes(8, "big"))
            queue.append(block)
        elif op == "appendleft" and not queued:
            block.block_hash = None
            queue.appendleft(block)
        elif op == "remove" and queued:
            queue.remove(block)
        elif op == "pop" and len(queue):
            taken = queue.popleft_n(min(1 + arg, len(queue)))
            popped.append([b.block_id for b in taken])
        elif op == "tick":
            clock.advance(arg * 7.5)
    return popped


def _check_membership(queue, blocks: list[KVBlock]) -> None:
    members = [b.block_id for b in queue]
    assert len(members) == len(set(members)) == len(queue)
    assert set(members) == {b.block_id for b in blocks if b.prev_free is not None}
    for b in blocks:
        assert (b in queue) == (b.prev_free is not None)


@settings(max_examples=150, deadline=None)
@given(ops=QUEUE_OPS, learn_after=st.sampled_from([0, 3, 10**9]))
def test_queue_keeps_the_free_queue_contract(ops, learn_after: int):
    clock = ManualClock(0.0)
    blocks = [KVBlock(block_id=i) for i in range(12)]
    queue = HitDensityQueue(blocks[:6], clock, min_observations=learn_after)
    queue._refresh_every = 2  # rebuild the tables (and score heads) as often as it can
    _check_membership(queue, blocks)
    for step in range(0, len(ops), 10):
        _drive(queue, blocks, clock, ops[step : step + 10])
        _check_membership(queue, blocks)
    with pytest.raises(IndexError):
        queue.popleft_n(len(queue) + 1)
    taken = queue.popleft_n(len(queue))
    assert all(b.prev_free is None for b in taken)
    assert len(queue) == 0
    _check_membership(queue, blocks)


def test_queue_rejects_double_insert_and_foreign_remove():
    queue = HitDensityQueue([], ManualClock(0.0))
    block = KVBlock(block_id=3)  # beyond the initial blocks: the per-block arrays grow
    queue.append(block)
    with pytest.raises(ValueError, match="already"):
        queue.append(block)
    with pytest.raises(ValueError, match="already"):
        queue.appendleft(block)
    queue.remove(block)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(block)


@settings(max_examples=150, deadline=None)
@given(ops=QUEUE_OPS)
def test_before_it_learns_it_evicts_in_lru_order(ops):
    """Same traffic, same pops: with no tables yet it is exactly the plain LRU queue."""
    clock_a, clock_b = ManualClock(0.0), ManualClock(0.0)
    blocks_a = [KVBlock(block_id=i) for i in range(12)]
    blocks_b = [KVBlock(block_id=i) for i in range(12)]
    lru = FreeBlockQueue(blocks_a[:6])
    density = HitDensityQueue(blocks_b[:6], clock_b, min_observations=10**9)
    assert _drive(lru, blocks_a, clock_a, ops) == _drive(density, blocks_b, clock_b, ops)
    assert {b.block_id for b in lru} == {b.block_id for b in density}
    assert [b.block_id for b in density.popleft_n(len(density))] == [
        b.block_id for b in lru.popleft_n(len(lru))
    ]
    assert not density.learned


def _regulars_story(eviction, seconds: int = 900, regulars: int = 6) -> tuple[int, int, BlockPool]:
    """A one-shot prompt every second (never seen again) and a few regular prompts that
    come back after 10-40 s, longer than the pool's LRU eviction age (about 19 s).
    Returns the regulars' full hits and visits over the second half, and the pool."""
    clock = ManualClock(0.0)
    pool = BlockPool(48, BLOCK, clock=clock, eviction=eviction)
    mgr = KVCacheManager(pool)
    due = {r: r for r in range(regulars)}
    hits = visits = 0
    for t in range(seconds):
        clock.now = float(t)
        serve(mgr, prompt(10_000 + t, 2))
        for r in range(regulars):
            if due[r] > t:
                continue
            full = serve(mgr, prompt(r, 2)) == 2 * BLOCK
            if t >= seconds // 2:
                visits += 1
                hits += full
            due[r] = t + 10 + (7 * t + 13 * r) % 31  # deterministic gaps of 10-40 s
    pool.check_invariants()
    return hits, visits, pool


def test_it_learns_to_keep_blocks_that_come_back_where_lru_does_not():
    lru_hits, visits, _ = _regulars_story(LRUEviction())
    credit_hits, _, _ = _regulars_story(ReuseCreditEviction())
    hits, same_visits, pool = _regulars_story(HitDensityEviction())
    assert same_visits == visits
    assert lru_hits < visits / 2  # LRU loses most of them to the one-shot stream
    assert hits == visits  # hit density keeps every regular once it has learned
    assert hits > credit_hits
    queue = pool.free_queue
    assert isinstance(queue, HitDensityQueue)
    assert queue.learned
    assert queue.factors[0] < 0.5 < 1.0 <= queue.factors[2]  # one-shots are class 0
    assert queue.eviction_age == pytest.approx(19, abs=6)
    # At the same idle age a twice-hit block scores above a never-hit one.
    assert queue.score(2, 20.0) > queue.score(0, 20.0)


def test_after_a_clear_the_emptied_blocks_go_first_and_teach_nothing():
    _, _, pool = _regulars_story(HitDensityEviction(), seconds=200)
    queue = pool.free_queue
    assert isinstance(queue, HitDensityQueue)
    weight = sum(h.weight for h in queue._stats)
    mgr = KVCacheManager(pool)
    mgr.clear()  # every cached block becomes empty and moves to the head list
    assert len(queue.head) == pool.num_blocks
    assert sum(h.weight for h in queue._stats) == weight  # moving them is no reuse
    for tag in range(15):
        serve(mgr, prompt(20_000 + tag, 2))  # 30 full blocks: fits in the emptied ones
    pool.check_invariants()
    assert sum(h.weight for h in queue._stats) == weight  # nothing was evicted
    assert all(serve(mgr, prompt(20_000 + tag, 2)) == 2 * BLOCK for tag in range(15))


def test_age_buckets_are_log_spaced_and_clamped():
    assert age_bucket(0.0) == age_bucket(-1.0) == 0
    assert age_bucket(1.0) + 4 == age_bucket(2.0)  # four buckets per octave
    assert age_bucket(1e12) == NUM_BUCKETS - 1
    buckets = [age_bucket(a / 10) for a in range(1, 100_000, 37)]
    assert buckets == sorted(buckets)


def test_decreasing_rates_pool_violators_and_extend_the_tail():
    hits = [0.05] * 40 + [0.0] * (NUM_BUCKETS - 40)  # young ages: 0.05 per second
    seconds = [1.0] * 40 + [0.0] * (NUM_BUCKETS - 40)  # old ages: no exposure at all
    hits[40], seconds[40] = 1.0, 100.0  # 0.01 per second
    hits[41], seconds[41] = 3.0, 100.0  # 0.03: violates, pooled with 40 to 0.02
    hits[42], seconds[42] = 0.0, 100.0  # no reuse: rate 0, then the 1/age tail
    rates = decreasing_rates(hits, seconds)
    assert rates[0] == rates[39] == pytest.approx(0.05)
    assert rates[40] == rates[41] == pytest.approx(0.02)
    assert all(a >= b for a, b in itertools.pairwise(rates))
    assert 0.0 < rates[42] < rates[41]
    assert rates[50] == pytest.approx(rates[42] / 4)  # two octaves older: a quarter
    assert decreasing_rates([0.0] * NUM_BUCKETS, [1.0] * NUM_BUCKETS) == [0.0] * NUM_BUCKETS


def test_histogram_scores_follow_the_fitted_rate():
    hist = ReuseHistogram()
    rate = 0.01
    hist.set_rates([rate] * NUM_BUCKETS)
    assert hist.score(30.0, 100.0) == pytest.approx(1 - math.exp(-rate * 100.0))
    assert hist.score(5.0, 0.0) == 0.0
    hist.record(3.0, reused=True)
    hist.record(7.0, reused=False)
    exposure = hist.exposure([0] * NUM_BUCKETS, [0.0] * NUM_BUCKETS)
    assert sum(exposure) == pytest.approx(3.0 + 7.0)  # every idle second, once
    hist.decay(0.5)
    assert hist.weight == pytest.approx(1.0)


def test_strategy_rejects_bad_settings():
    with pytest.raises(ValueError, match="horizon_share"):
        HitDensityEviction(horizon_share=-1.0)
    with pytest.raises(ValueError, match="half_life"):
        HitDensityEviction(half_life=0.0)
    with pytest.raises(ValueError, match="min_observations"):
        HitDensityEviction(min_observations=-1)


POOL_OPS = st.lists(
    st.tuples(
        st.sampled_from(["serve", "hold", "release", "retain", "tick", "clear"]), st.integers(0, 5)
    ),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(ops=POOL_OPS, num_blocks=st.integers(3, 10))
def test_the_pool_keeps_its_invariants_while_the_queue_learns(ops, num_blocks: int):
    """The registry-wide invariant tests run the default, which never learns in a few
    dozen steps; this one learns from the first observation and rebuilds at every one."""
    clock = ManualClock(0.0)
    pool = BlockPool(
        num_blocks, BLOCK, clock=clock, eviction=HitDensityEviction(min_observations=0)
    )
    queue = pool.free_queue
    assert isinstance(queue, HitDensityQueue)
    queue._refresh_every = 1
    mgr = KVCacheManager(pool)
    held: list = []
    for op, arg in ops:
        apply_pool_op(op, arg, pool, mgr, clock, held, tick_s=3.0, expire_on_tick=False)
        pool.check_invariants()
