from __future__ import annotations

import pytest

from cachepoint.kvcore import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    PoolExhaustedError,
    hash_blocks,
)

BLOCK = 4  # the pool fixture's block size


def _fill(pool: BlockPool, tokens: list[int]) -> list:
    """Allocate, publish and free a chain; returns its hashes."""
    hs = hash_blocks(tokens, BLOCK)
    blocks = pool.allocate(len(hs))
    pool.publish(blocks, hs, None)
    pool.free(reversed(blocks))
    return hs


def test_pool_starts_empty(pool: BlockPool):
    c = pool.counts()
    assert (c.total, c.active, c.cached_free, c.empty, c.retained) == (8, 0, 0, 8, 0)
    pool.check_invariants()


def test_pool_publish_emits_stored_with_parent(pool: BlockPool):
    hs = hash_blocks(list(range(12)), BLOCK)
    blocks = pool.allocate(3)
    assert pool.publish(blocks[1:], hs[1:], hs[0]) == 2
    assert pool.take_events() == [BlockStored(tuple(hs[1:]), hs[0])]
    assert pool.take_events() == []
    pool.check_invariants()


def test_pool_publish_skips_duplicate_and_splits_runs(pool: BlockPool):
    hs = hash_blocks(list(range(12)), BLOCK)
    first = pool.allocate(1)
    pool.publish(first, hs[1:2], hs[0])
    pool.take_events()
    second = pool.allocate(3)
    assert pool.publish(second, hs, None) == 2
    assert pool.take_events() == [BlockStored((hs[0],), None), BlockStored((hs[2],), hs[1])]
    assert second[1].block_hash is None  # the duplicate stays unindexed
    pool.check_invariants()


def test_pool_free_order_evicts_chain_tail_first(pool: BlockPool):
    hs = _fill(pool, list(range(8 * BLOCK)))
    pool.take_events()
    evicted = pool.allocate(1)
    assert pool.take_events() == [BlockRemoved((hs[-1],))]
    assert evicted[0].block_hash is None
    assert pool.get_cached(hs[-1]) is None
    assert pool.get_cached(hs[0]) is not None
    assert pool.num_evictions == 1
    pool.check_invariants()


def test_pool_empty_blocks_are_reused_before_eviction(pool: BlockPool):
    hs = _fill(pool, list(range(4 * BLOCK)))
    pool.take_events()
    blocks = pool.allocate(4)
    assert all(b.block_hash is None for b in blocks)
    assert pool.take_events() == []
    assert all(pool.get_cached(h) is not None for h in hs)
    pool.check_invariants()


def test_pool_touch_pulls_hit_out_of_queue(pool: BlockPool):
    hs = _fill(pool, list(range(2 * BLOCK)))
    hit = pool.match_prefix(hs, 10)
    pool.touch(hit)
    c = pool.counts()
    assert (c.active, c.cached_free) == (2, 0)
    pool.check_invariants()
    pool.free(reversed(hit))
    assert pool.counts().cached_free == 2
    pool.check_invariants()


def test_pool_exhausted_is_a_clear_error(pool: BlockPool):
    pool.allocate(6)
    with pytest.raises(PoolExhaustedError, match="need 3 free blocks, have 2"):
        pool.allocate(3)
    pool.check_invariants()


def test_pool_double_free_and_bad_publish_rejected(pool: BlockPool):
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])
    with pytest.raises(ValueError, match="not held"):
        pool.publish([b], hash_blocks(list(range(4)), BLOCK), None)


def test_pool_clear_empties_index_and_emits_cleared(pool: BlockPool):
    hs = _fill(pool, list(range(3 * BLOCK)))
    held = pool.allocate(1)
    pool.retain([pool.get_cached(hs[0])], 60)
    pool.take_events()
    pool.clear()
    assert pool.take_events() == [AllBlocksCleared()]
    c = pool.counts()
    assert (c.active, c.cached_free, c.retained, c.empty) == (1, 0, 0, 7)
    pool.check_invariants()
    pool.free(held)
    assert pool.counts().empty == 8
    pool.check_invariants()


def test_pool_rejects_bad_construction():
    with pytest.raises(ValueError, match="positive"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="retained_share"):
        BlockPool(4, 16, retained_share=1.5)
