from __future__ import annotations

import random

import pytest

from cachepoint.kvcore import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    ManualClock,
    PrefixIndex,
    Tier,
    TierStore,
    hash_blocks,
)
from cachepoint.kvcore.prefix_index import TierMatch


def test_prefix_index_match_counts_leading_blocks():
    hs = hash_blocks(list(range(64)), 16)
    idx = PrefixIndex(hs[:2])
    assert idx.match(hs) == 2
    assert idx.match(hs[1:]) == 1
    assert idx.match([]) == 0
    assert hs[0] in idx
    assert len(idx) == 2


def test_prefix_index_follows_pool_events_exactly():
    """Stored, removed and cleared reach the index; it mirrors the pool's own index."""
    pool = BlockPool(6, 4, clock=ManualClock())
    mgr = KVCacheManager(pool)
    idx = PrefixIndex()
    for start in (0, 100, 200, 300):
        toks = list(range(start, start + 13))
        hs = hash_blocks(toks, 4)
        a = mgr.allocate(hs, len(toks))
        a.commit()
        a.free()
        idx.apply_all(mgr.take_events())
        assert len(idx) == len(pool.cached)
        assert all(h in idx for h in pool.cached)
        assert idx.match(hs) == mgr.match(hs, len(toks) + 4).num_blocks
    mgr.clear()
    events = mgr.take_events()
    assert events == [AllBlocksCleared()]
    idx.apply_all(events)
    assert len(idx) == 0


def test_prefix_index_replace_and_bad_event():
    hs = hash_blocks(list(range(32)), 16)
    idx = PrefixIndex()
    idx.replace(hs)
    assert idx.match(hs) == 2
    with pytest.raises(TypeError):
        idx.apply("stored")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- tiers


def test_stored_in_a_new_tier_moves_the_hash():
    hs = hash_blocks(list(range(64)), 16)
    idx = PrefixIndex()
    idx.apply(BlockStored(tuple(hs[:3]), None))
    # A demotion: removed from the device at eviction, stored in host once copied.
    idx.apply(BlockRemoved((hs[2],)))
    assert hs[2] not in idx
    idx.apply(BlockStored((hs[2],), None, Tier.HOST))
    assert idx.tier_of(hs[2]) is Tier.HOST
    assert (idx.size(Tier.DEVICE), idx.size(Tier.HOST), len(idx)) == (2, 1, 3)
    # A stored in another tier moves the hash, even without a removed first.
    idx.apply(BlockStored((hs[2],), None, Tier.DISK))
    assert idx.tier_of(hs[2]) is Tier.DISK
    assert (idx.size(Tier.HOST), idx.size(Tier.DISK), len(idx)) == (0, 1, 3)


@pytest.mark.parametrize("removed_first", [False, True])
def test_promotion_lands_on_the_device_in_either_order(removed_first: bool):
    hs = hash_blocks(list(range(32)), 16)
    idx = PrefixIndex()
    idx.apply(BlockStored(tuple(hs), None, Tier.HOST))
    promote = [BlockStored(tuple(hs), None, Tier.DEVICE), BlockRemoved(tuple(hs), Tier.HOST)]
    idx.apply_all(reversed(promote) if removed_first else promote)
    assert [idx.tier_of(h) for h in hs] == [Tier.DEVICE, Tier.DEVICE]
    assert (idx.size(Tier.HOST), len(idx)) == (0, 2)


def test_removed_for_another_tier_does_not_drop_the_hash():
    hs = hash_blocks(list(range(32)), 16)
    idx = PrefixIndex()
    idx.apply(BlockStored((hs[0],), None, Tier.HOST))
    idx.apply(BlockStored((hs[1],), hs[0]))
    idx.apply(BlockRemoved((hs[0],)))  # device: it is in host
    idx.apply(BlockRemoved((hs[1],), Tier.DISK))  # disk: it is on the device
    assert (idx.tier_of(hs[0]), idx.tier_of(hs[1])) == (Tier.HOST, Tier.DEVICE)
    idx.apply(BlockRemoved((hs[0],), Tier.HOST))
    assert idx.tier_of(hs[0]) is None
    assert len(idx) == 1


def test_match_tiers_counts_the_device_run_then_the_lower_run():
    hs = hash_blocks(list(range(16 * 8)), 16)
    idx = PrefixIndex()
    idx.apply(BlockStored(tuple(hs[:2]), None))
    idx.apply(BlockStored((hs[2], hs[4]), None, Tier.HOST))
    idx.apply(BlockStored((hs[3],), None, Tier.DISK))
    idx.apply(BlockStored((hs[5], hs[7]), hs[4]))  # on the device again after the lower run
    m = idx.match_tiers(hs)
    assert (m.device, m.host, m.disk) == (2, 2, 1)
    # The replica's lookup stops at a device block after the lower run: so does the index.
    assert (m.blocks, m.lower) == (5, 3)
    assert idx.match(hs) == 5
    assert idx.match_tiers(hs[2:]) == TierMatch(0, 2, 1)
    assert idx.match(hs[2:]) == 3
    assert idx.match_tiers(hs[6:]) == TierMatch()
    assert idx.match_tiers([]) == TierMatch()
    # A device-only index: the device run, as before tiers.
    assert PrefixIndex(hs[:3]).match_tiers(hs) == TierMatch(3)


def test_cleared_and_replace_cover_every_tier():
    hs = hash_blocks(list(range(16 * 6)), 16)
    idx = PrefixIndex(hs[:1])
    idx.apply(BlockStored(tuple(hs[1:3]), None, Tier.HOST))
    idx.apply(BlockStored(tuple(hs[3:4]), None, Tier.DISK))
    assert idx.has_lower
    idx.apply(AllBlocksCleared())
    assert len(idx) == 0 and not idx.has_lower
    # A hash listed in two tiers (a snapshot taken mid-move) is kept in the faster one.
    idx.replace(hs[:2], host=hs[1:4], disk=hs[3:5])
    assert [idx.tier_of(h) for h in hs] == [
        Tier.DEVICE,
        Tier.DEVICE,
        Tier.HOST,
        Tier.HOST,
        Tier.DISK,
        None,
    ]
    assert idx.match_tiers(hs) == TierMatch(2, 2, 1)
    idx.replace(hs[:1])
    assert (len(idx), idx.has_lower) == (1, False)
    # Events after a replace still reach the new sets.
    idx.apply(BlockStored((hs[5],), None, Tier.HOST))
    assert idx.tier_of(hs[5]) is Tier.HOST


def test_unknown_tier_is_a_clear_error():
    hs = hash_blocks(list(range(16)), 16)
    idx = PrefixIndex()
    with pytest.raises(ValueError, match="unknown tier 'tape'"):
        idx.apply(BlockStored(tuple(hs), None, "tape"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tier"):
        idx.size("tape")  # type: ignore[arg-type]
    assert len(idx) == 0


@pytest.mark.parametrize("copies_ok", [True, False])
def test_prefix_index_follows_a_tiered_pool_exactly(copies_ok: bool):
    """Demotions, promotions and failed copies reach the index through events alone: after
    every step each hash sits in the tier where the replica would hit it, and the index
    predicts the replica's own match (device run, then lower run) block for block."""
    clock = ManualClock()
    disk = TierStore(Tier.DISK, 6, clock=clock)
    host = TierStore(Tier.HOST, 4, clock=clock, lower=disk)
    pool = BlockPool(6, 4, clock=clock, lower=host)
    mgr = KVCacheManager(pool)
    idx = PrefixIndex()
    rng = random.Random(7)
    prompts = [hash_blocks(list(range(s * 100, s * 100 + 13)), 4) for s in range(8)]
    seen = {Tier.HOST: 0, Tier.DISK: 0, "lower_hits": 0}
    for _ in range(120):
        hs = prompts[rng.randrange(len(prompts))]
        a = mgr.allocate(hs, 13)
        mgr.finish_copies(mgr.take_copies(), copies_ok)
        a.commit()
        a.free()
        mgr.finish_copies(mgr.take_copies(), copies_ok)
        idx.apply_all(mgr.take_events())
        for h in {h for p in prompts for h in p}:
            found = host.find(h)
            want = Tier.DEVICE if h in pool.cached else (found[0].tier if found else None)
            assert idx.tier_of(h) is want
        for p in prompts:
            m = mgr.match(p, 13 + 4)
            got = idx.match_tiers(p)
            assert (got.blocks, got.lower) == (m.num_blocks, m.lower_blocks)
            assert idx.match(p) == m.num_blocks
            seen["lower_hits"] += got.lower
        seen[Tier.HOST] += idx.size(Tier.HOST)
        seen[Tier.DISK] += idx.size(Tier.DISK)
    # The workload did move blocks down and hit them there (with copies that succeed).
    assert (min(seen.values()) > 0) is copies_ok
