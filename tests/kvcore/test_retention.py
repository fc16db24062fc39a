from __future__ import annotations

import pytest

from cachepoint.kvcore import BlockPool, ManualClock, hash_blocks

BLOCK = 4  # the pool fixture's block size


def _cached_chain(pool: BlockPool, n: int, start: int = 0) -> list:
    hs = hash_blocks(list(range(start, start + n * BLOCK)), BLOCK)
    blocks = pool.allocate(n)
    pool.publish(blocks, hs, None)
    pool.free(reversed(blocks))
    return blocks


def test_retention_survives_lru_pressure(pool: BlockPool, clock: ManualClock):
    kept = _cached_chain(pool, 2)
    assert pool.retain(kept, 300).ok
    _cached_chain(pool, 2, start=1000)
    # 8 blocks, 2 retained: allocating all 6 others must not touch the retained two.
    pool.allocate(6)
    assert all(b.block_hash is not None for b in kept)
    with pytest.raises(Exception, match="need 1 free blocks, have 0"):
        pool.allocate(1)
    pool.check_invariants()


def test_retention_expires_then_evicts_first(pool: BlockPool, clock: ManualClock):
    kept = _cached_chain(pool, 2)
    pool.retain(kept, 300)
    _cached_chain(pool, 2, start=1000)
    clock.advance(299.9)
    assert pool.counts().retained == 2
    clock.advance(0.1)
    assert pool.counts().retained == 0
    pool.check_invariants()
    # The expired blocks went to the head of the LRU queue, chain tail first.
    [first] = pool.allocate(1)
    assert first is kept[1]
    pool.check_invariants()


def test_retention_refresh_extends_never_shortens(pool: BlockPool, clock: ManualClock):
    kept = _cached_chain(pool, 1)
    pool.retain(kept, 3600)
    r = pool.retain(kept, 300)
    assert r.ok
    assert r.newly_retained == 0
    assert kept[0].retained_until == pytest.approx(clock.now + 3600)
    clock.advance(1000)
    assert pool.counts().retained == 1
    pool.check_invariants()


def test_retention_cap_refuses_whole_request(pool: BlockPool):
    # cap = 0.5 * 8 = 4 blocks
    a = _cached_chain(pool, 3)
    b = _cached_chain(pool, 2, start=500)
    assert pool.retain(a, 300).ok
    r = pool.retain(b, 300)
    assert not r.ok
    assert r.reason is not None
    assert "3 of 4 blocks retained, 2 more requested" in r.reason
    assert all(x.retained_until == 0.0 for x in b)
    assert pool.num_retain_refusals == 1
    pool.check_invariants()


def test_retention_of_active_block_parks_on_free(pool: BlockPool, clock: ManualClock):
    hs = hash_blocks(list(range(BLOCK)), BLOCK)
    blocks = pool.allocate(1)
    pool.publish(blocks, hs, None)
    pool.retain(blocks, 60)
    pool.free(blocks)
    assert blocks[0] not in pool.free_queue
    pool.check_invariants()
    clock.advance(61)
    pool.expire()
    assert blocks[0] in pool.free_queue
    pool.check_invariants()


def test_retention_rejects_unindexed_block_and_bad_ttl(pool: BlockPool):
    [b] = pool.allocate(1)
    with pytest.raises(ValueError, match="not indexed"):
        pool.retain([b], 60)
    with pytest.raises(ValueError, match="ttl"):
        pool.retain([], 0)
