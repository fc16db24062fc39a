from __future__ import annotations

import pytest

from cachepoint.kvcore import (
    AllocationError,
    AllocationState,
    BlockPool,
    BlockStored,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    RetentionOwner,
    entry_key_at,
    hash_blocks,
)

BLOCK = 4  # the pool fixture's block size


def _prompt(n: int, start: int = 0) -> tuple[list[int], list]:
    toks = list(range(start, start + n))
    return toks, hash_blocks(toks, BLOCK)


def test_manager_allocate_cold_then_hit(manager: KVCacheManager):
    toks, hs = _prompt(10)  # 2 full blocks + 2 tokens
    with manager.allocate(hs, len(toks)) as a:
        assert a.num_cached_tokens == 0
        assert len(a.blocks) == 3
        assert a.commit() == 2
        first_ids = a.block_ids
    assert a.state is AllocationState.FREED
    b = manager.allocate(hs, len(toks))
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == first_ids[:2]
    b.commit()
    b.free()
    s = manager.stats()
    assert (s.query_tokens, s.hit_tokens) == (20, 8)
    manager.pool.check_invariants()


def test_manager_never_hits_the_last_token(manager: KVCacheManager):
    _toks, hs = _prompt(8)  # exactly 2 full blocks
    a = manager.allocate(hs, 8)
    a.commit()
    a.free()
    assert manager.match(hs, 8).num_blocks == 1
    b = manager.allocate(hs, 8)
    assert b.num_cached_tokens == 4  # the block with the last token is recomputed
    b.abort()
    manager.pool.check_invariants()


def test_manager_abort_publishes_nothing_and_restores_refcounts(manager: KVCacheManager):
    _toks, hs = _prompt(12)
    a = manager.allocate(hs[:1], 4 + 1)
    a.commit()  # first block cached, still held
    refs_before = [b.ref_cnt for b in manager.pool.blocks]
    manager.take_events()
    b = manager.allocate(hs, 12)
    assert b.num_hit_blocks == 1
    b.abort()
    assert [x.ref_cnt for x in manager.pool.blocks] == refs_before
    assert manager.take_events() == []
    assert manager.match(hs, 12).num_blocks == 1
    manager.pool.check_invariants()
    with pytest.raises(AllocationError, match="aborted"):
        b.commit()


def test_manager_exception_in_context_aborts(manager: KVCacheManager):
    _toks, hs = _prompt(12)
    with pytest.raises(RuntimeError), manager.allocate(hs, 12) as a:
        raise RuntimeError("forward pass failed")
    assert a.state is AllocationState.ABORTED
    assert manager.match(hs, 12).num_blocks == 0
    assert manager.take_events() == []
    manager.pool.check_invariants()


def test_manager_exhausted_allocation_leaves_pool_untouched(manager: KVCacheManager):
    _toks, hs = _prompt(8)
    a = manager.allocate(hs, 9)
    a.commit()
    a.free()
    before = manager.stats().blocks
    _toks2, hs2 = _prompt(40, start=100)
    with pytest.raises(PoolExhaustedError):
        manager.allocate(hs2, 40)
    assert manager.stats().blocks == before
    manager.pool.check_invariants()


def test_manager_grow_and_commit_decode_blocks(manager: KVCacheManager):
    toks, hs = _prompt(6)
    a = manager.allocate(hs, 6)
    a.commit()
    manager.take_events()
    assert len(a.grow(9)) == 1  # 6 -> 9 tokens needs a third block
    full = hash_blocks([*toks, 6, 7], BLOCK)
    assert a.commit(full) == 1
    assert manager.take_events() == [BlockStored((full[1],), full[0])]
    with pytest.raises(AllocationError, match="extend"):
        a.commit(hash_blocks(list(range(50, 58)), BLOCK))
    a.free()
    manager.pool.check_invariants()


def test_manager_rejects_bad_arguments(manager: KVCacheManager):
    _, hs = _prompt(8)
    with pytest.raises(ValueError, match="positive"):
        manager.allocate(hs, 0)
    with pytest.raises(ValueError, match="more block hashes"):
        manager.allocate(hs, 7)


def _write(manager: KVCacheManager, n: int, ttl: float, start: int = 0):
    toks, hs = _prompt(n, start)
    a = manager.allocate(hs, n)
    a.commit()
    key = entry_key_at(toks, n, hs, BLOCK, ())
    w = manager.write_entry(key, n, hs, ttl)
    a.free()
    return toks, hs, key, w


def test_manager_entry_write_then_hit_refreshes(manager: KVCacheManager, clock: ManualClock):
    _toks, _hs, key, w = _write(manager, 10, 300)
    assert w.written
    assert w.expires_at == clock.now + 300
    clock.advance(200)
    hit = manager.lookup_entry([key])
    assert hit is not None
    assert (hit.num_tokens, hit.lookback) == (10, 0)
    assert hit.expires_at == clock.now + 300
    clock.advance(250)  # 450 s after the write, 250 after the hit
    assert manager.lookup_entry([key]) is not None
    assert manager.stats().blocks.retained == 2
    clock.advance(301)
    assert manager.lookup_entry([key]) is None
    assert manager.stats().blocks.retained == 0
    assert manager.stats().entries == 0
    manager.pool.check_invariants()


def test_manager_entry_lookback_limit(manager: KVCacheManager):
    _toks, _hs, key, _ = _write(manager, 9, 300)
    misses = [
        entry_key_at(list(range(100)), n, hash_blocks(list(range(100)), BLOCK), BLOCK, ())
        for n in range(50, 70)
    ]
    assert manager.lookup_entry([*misses[:19], key]).lookback == 19
    assert manager.lookup_entry([*misses, key]) is None  # the 21st candidate is not checked


def test_manager_entry_refused_when_cap_full(manager: KVCacheManager):
    _write(manager, 16, 300)  # 4 blocks retained = the cap
    _toks, _hs, key, w = _write(manager, 8, 300, start=500)
    assert not w.written
    assert w.refused_reason is not None
    assert "retained share cap" in w.refused_reason
    assert manager.lookup_entry([key]) is None
    manager.pool.check_invariants()


def test_manager_entry_ttl_upgrade_keeps_longest(manager: KVCacheManager, clock: ManualClock):
    _toks, hs, key, _ = _write(manager, 8, 300)
    w = manager.write_entry(key, 8, hs, 3600)
    assert w.written
    clock.advance(1000)
    hit = manager.lookup_entry([key])
    assert hit is not None
    assert hit.ttl == 3600


def test_manager_entry_needs_resident_blocks(manager: KVCacheManager):
    toks, hs = _prompt(8)
    key = entry_key_at(toks, 8, hs, BLOCK, ())
    w = manager.write_entry(key, 8, hs, 300)
    assert not w.written
    assert w.refused_reason == "prefix blocks are not resident"


def test_manager_clear_drops_entries_and_blocks(manager: KVCacheManager):
    _toks, hs, key, _ = _write(manager, 8, 300)
    manager.clear()
    assert manager.lookup_entry([key]) is None
    assert manager.match(hs, 9).num_blocks == 0
    s = manager.stats()
    assert (s.entries, s.blocks.retained, s.blocks.empty) == (0, 0, 8)
    manager.pool.check_invariants()


def _write_as(manager: KVCacheManager, n: int, ttl: float, start: int, owner: RetentionOwner):
    toks, hs = _prompt(n, start)
    a = manager.allocate(hs, n)
    a.commit()
    key = entry_key_at(toks, n, hs, BLOCK, ())
    w = manager.write_entry(key, n, hs, ttl, owner)
    a.free()
    return key, w


def test_manager_entries_are_charged_to_their_owner(clock: ManualClock):
    # 16 blocks, cap 8, each owner 4: org a's third 2-block entry is over its quota.
    manager = KVCacheManager(BlockPool(16, BLOCK, owner_share=0.5, clock=clock))
    a, b = RetentionOwner("org:a"), RetentionOwner("org:b")
    assert _write_as(manager, 8, 3600, 0, a)[1].written
    assert _write_as(manager, 8, 3600, 100, a)[1].written
    key, w = _write_as(manager, 8, 3600, 200, a)
    assert not w.written
    assert w.refused_reason == "tenant retention quota: 4 of 4 blocks retained, 2 more requested"
    assert manager.lookup_entry([key]) is None  # refused: no entry to read later
    key_b, w_b = _write_as(manager, 8, 3600, 300, b)
    assert w_b.written
    clock.advance(1800)
    assert manager.lookup_entry([key_b]) is not None  # a hit refreshes, charges nothing
    assert manager.pool.retained_owners() == {"org:a": 4, "org:b": 2}
    s = manager.stats()
    assert (s.retain_refusals, s.quota_refusals) == (1, 1)
    clock.advance(1801)  # a's entries expire; b's was refreshed 1801 s ago
    assert manager.pool.retained_owners() == {"org:b": 2}
    manager.pool.check_invariants()


def test_manager_rewrite_with_shorter_ttl_keeps_blocks_as_long_as_entry(
    manager: KVCacheManager, clock: ManualClock
):
    """An entry keeps its longest TTL; its blocks must stay retained just as long."""
    _toks, hs, key, _ = _write(manager, 8, 3600)
    clock.advance(3500)
    w = manager.write_entry(key, 8, hs, 300)  # e.g. a concurrent request's 5m marker
    assert w.expires_at == clock.now + 3600
    assert all(manager.pool.get_cached(h).retained_until == clock.now + 3600 for h in hs[:2])
    clock.advance(3000)  # past the 5m, within the entry's 1h
    assert manager.stats().blocks.retained == 2
    assert manager.lookup_entry([key]) is not None
    manager.pool.check_invariants()
