from __future__ import annotations

import pytest

from cachepoint.kvcore import UNATTRIBUTED, BlockPool, ManualClock, RetentionOwner, hash_blocks

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


# ------------------------------------------------------------ per-owner quotas


def _quota_pool(clock: ManualClock, owner_share: float = 0.5) -> BlockPool:
    # 8 blocks, cap 4 retained; owner_share 0.5 -> each owner may hold 2 of them.
    return BlockPool(8, BLOCK, retained_share=0.5, owner_share=owner_share, clock=clock)


A, B = RetentionOwner("org:a"), RetentionOwner("org:b")


def test_owner_quota_refuses_the_owner_and_spares_the_others(clock: ManualClock):
    pool = _quota_pool(clock)
    a = _cached_chain(pool, 3)
    b = _cached_chain(pool, 2, start=500)
    assert pool.owner_quota(A) == 2
    assert pool.retain(a[:2], 3600, A).ok
    r = pool.retain(a, 3600, A)
    assert not r.ok
    assert r.reason == "tenant retention quota: 2 of 2 blocks retained, 1 more requested"
    assert a[2].retained_until == 0.0  # all or nothing: nothing changed
    assert (pool.num_quota_refusals, pool.num_retain_refusals) == (1, 1)
    # The pool still has room for someone else: org b is not starved by org a.
    assert pool.retain(b, 3600, B).ok
    assert pool.retained_owners() == {"org:a": 2, "org:b": 2}
    pool.check_invariants()
    # Expiry releases the charge, so org a may retain again.
    clock.advance(3600)
    assert pool.retained_owners() == {}
    assert pool.retain(a[2:], 300, A).ok
    assert pool.retained_by("org:a") == 1
    pool.check_invariants()


def test_owner_share_overrides_the_pool_default(clock: ManualClock):
    pool = _quota_pool(clock)
    blocks = _cached_chain(pool, 5)
    assert not pool.retain(blocks[:1], 60, RetentionOwner("org:z", share=0.0)).ok
    big = RetentionOwner("org:big", share=1.0)
    assert pool.owner_quota(big) == pool.max_retained == 4
    assert pool.retain(blocks[:4], 60, big).ok
    # Share 1.0 is no per-owner limit: past the cap, the cap is the reason given.
    r = pool.retain(blocks, 60, big)
    assert r.reason is not None
    assert r.reason.startswith("retained share cap")
    with pytest.raises(ValueError, match="within"):
        RetentionOwner("org:x", share=1.5)
    pool.check_invariants()


def test_shared_block_stays_charged_to_its_first_owner(clock: ManualClock):
    pool = _quota_pool(clock)
    x, y = _cached_chain(pool, 2)
    assert pool.retain([x], 300, A).ok
    # b retains x (already a's) and y: only y is new, so only y is charged to b.
    r = pool.retain([x, y], 3600, B)
    assert r.ok
    assert r.newly_retained == 1
    assert (x.retained_by, y.retained_by) == ("org:a", "org:b")
    assert pool.retained_owners() == {"org:a": 1, "org:b": 1}
    clock.advance(301)  # a's own 5m would have ended; b's 1h keeps x, still a's charge
    assert pool.counts().retained == 2
    assert pool.retained_by("org:a") == 1
    clock.advance(3300)
    assert pool.retained_owners() == {}
    assert pool.counts().retained == 0
    pool.check_invariants()


def test_refresh_is_never_refused_by_a_lowered_quota(clock: ManualClock):
    pool = _quota_pool(clock, owner_share=1.0)
    blocks = _cached_chain(pool, 3)
    assert pool.retain(blocks, 300, A).ok
    # The admin lowers org a's share below what it holds: what was sold stays sold,
    # a refresh moves deadlines only, and anything new is refused.
    low = RetentionOwner("org:a", share=0.25)
    assert pool.retain(blocks, 3600, low).ok
    assert all(b.retained_until == clock.now + 3600 for b in blocks)
    more = _cached_chain(pool, 1, start=900)
    assert not pool.retain(more, 300, low).ok
    pool.check_invariants()


def test_unattributed_retains_share_one_owner(clock: ManualClock):
    pool = _quota_pool(clock)
    blocks = _cached_chain(pool, 3)
    assert pool.retain(blocks[:2], 60).ok
    assert pool.retained_by(UNATTRIBUTED.key) == 2
    assert not pool.retain(blocks, 60).ok  # the default share applies to them together
    pool.clear()
    assert pool.retained_owners() == {}
    pool.check_invariants()
