"""Eviction strategies: the order each one evicts in, and every pool invariant under each."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.kvcore import (
    EVICTION_POLICIES,
    BlockPool,
    KVBlock,
    KVCacheManager,
    LRUEviction,
    ManualClock,
    PriorityFreeQueue,
    ReuseCreditEviction,
    ReuseCreditQueue,
    SegmentedLRUEviction,
    hash_blocks,
)

from .helpers import BLOCK, apply_pool_op, prompt, serve


def _cached(pool: BlockPool, tokens: list[int]) -> bool:
    return all(pool.get_cached(h) is not None for h in hash_blocks(tokens, BLOCK))


def test_hits_are_counted_and_reset_when_a_block_is_reused():
    pool = BlockPool(4, BLOCK)
    mgr = KVCacheManager(pool)
    serve(mgr, prompt(1, 2))
    serve(mgr, prompt(1, 2))
    assert [pool.get_cached(h).hits for h in hash_blocks(prompt(1, 2), BLOCK)] == [1, 1]  # type: ignore[union-attr]
    serve(mgr, prompt(2, 3))  # needs all four blocks: evicts everything
    assert all(b.hits == 0 for b in pool.blocks)


@pytest.mark.parametrize(
    "eviction", [SegmentedLRUEviction(protected_share=0.5), ReuseCreditEviction(credit_share=10.0)]
)
def test_a_hit_block_outlives_a_fresher_block_never_hit(eviction):
    clock = ManualClock(0.0)
    pool = BlockPool(6, BLOCK, clock=clock, eviction=eviction)
    mgr = KVCacheManager(pool)
    for tag in (10, 11, 12):  # churn first, so the pool has an eviction age to give credit from
        clock.advance(1)
        serve(mgr, prompt(tag, 2))
    serve(mgr, prompt(1, 2))  # A
    clock.advance(1)
    assert serve(mgr, prompt(1, 2)) == 2 * BLOCK  # A hit once
    for tag in (2, 3, 4, 5):  # a stream of one-shot prompts
        clock.advance(1)
        serve(mgr, prompt(tag, 2))
    assert _cached(pool, prompt(1, 2))
    assert not _cached(pool, prompt(2, 2))
    pool.check_invariants()


def test_lru_evicts_the_hit_block_in_the_same_story():
    clock = ManualClock(0.0)
    pool = BlockPool(6, BLOCK, clock=clock, eviction=LRUEviction())
    mgr = KVCacheManager(pool)
    serve(mgr, prompt(1, 2))
    serve(mgr, prompt(1, 2))
    for tag in (2, 3, 4, 5):
        serve(mgr, prompt(tag, 2))
    assert not _cached(pool, prompt(1, 2))


def test_segmented_protected_segment_is_capped_and_demotes_to_probation():
    pool = BlockPool(8, BLOCK, eviction=SegmentedLRUEviction(protected_share=0.25))
    mgr = KVCacheManager(pool)
    for tag in (1, 2):
        serve(mgr, prompt(tag, 2))
        serve(mgr, prompt(tag, 2))
    queue = pool.free_queue
    assert queue.protected.num_free == 2  # type: ignore[attr-defined]
    assert len(queue) == 8
    pool.check_invariants()


def test_reuse_credit_measures_the_eviction_age():
    clock = ManualClock(0.0)
    pool = BlockPool(5, BLOCK, clock=clock, eviction=ReuseCreditEviction())
    mgr = KVCacheManager(pool)
    queue = pool.free_queue
    assert isinstance(queue, ReuseCreditQueue)
    serve(mgr, prompt(1, 4))
    assert queue.eviction_age == 0.0  # nothing evicted yet
    clock.advance(30)
    serve(mgr, prompt(2, 4))  # evicts prompt 1's four blocks, freed 30 s ago
    assert queue.eviction_age == pytest.approx(30.0)
    clock.advance(10)
    serve(mgr, prompt(3, 4))
    assert 10.0 < queue.eviction_age < 30.0


def test_zero_credit_is_lru_order():
    clock = ManualClock(0.0)
    lru = BlockPool(6, BLOCK, clock=clock)
    credit = BlockPool(6, BLOCK, clock=clock, eviction=ReuseCreditEviction(credit_share=0.0))
    for pool in (lru, credit):
        mgr = KVCacheManager(pool)
        for tag in (1, 1, 2, 3, 1, 4):
            clock.advance(1)
            serve(mgr, prompt(tag, 2))
    assert set(lru.cached) == set(credit.cached)


def test_priority_queue_lazy_removal_compaction_and_head_first():
    blocks = [KVBlock(block_id=i) for i in range(4)]
    order = {0: 5.0, 1: 1.0, 2: 3.0, 3: 2.0}
    queue = PriorityFreeQueue([], lambda b: order[b.block_id])
    for b in blocks:
        queue.append(b)
    queue.remove(blocks[3])
    for _ in range(3000):  # churn: compaction must keep only live entries
        queue.append(blocks[3])
        queue.remove(blocks[3])
    assert len(queue._heap) < 2 * len(queue) + 1100
    queue.appendleft(blocks[3])
    assert {b.block_id for b in queue} == {0, 1, 2, 3}
    assert [b.block_id for b in queue.popleft_n(4)] == [3, 1, 2, 0]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft_n(1)
    queue.append(blocks[0])
    with pytest.raises(ValueError, match="already"):
        queue.append(blocks[0])


def test_strategies_reject_bad_settings_and_are_named():
    with pytest.raises(ValueError, match="protected_share"):
        SegmentedLRUEviction(protected_share=1.5)
    with pytest.raises(ValueError, match="credit_share"):
        ReuseCreditEviction(credit_share=-1)
    assert {name: cls().name for name, cls in EVICTION_POLICIES.items()} == {
        "lru": "lru",
        "slru": "slru",
        "reuse_credit": "reuse_credit",
        "hit_density": "hit_density",
    }


OPS = st.lists(
    st.tuples(
        st.sampled_from(["serve", "hold", "release", "retain", "tick", "clear"]), st.integers(0, 5)
    ),
    max_size=40,
)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(3, 10))
def test_every_strategy_keeps_the_pool_invariants(name: str, ops, num_blocks: int):
    clock = ManualClock(0.0)
    pool = BlockPool(
        num_blocks, BLOCK, retained_share=0.5, clock=clock, eviction=EVICTION_POLICIES[name]()
    )
    mgr = KVCacheManager(pool)
    held: list = []
    for op, arg in ops:
        apply_pool_op(op, arg, pool, mgr, clock, held)
        pool.check_invariants()
        for h, block in pool.cached.items():
            assert block.block_hash == h
