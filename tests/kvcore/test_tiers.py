"""The tiered pool: demotion on eviction, promotion on a hit, write-then-publish across tiers."""

from __future__ import annotations

import pytest

from cachepoint.kvcore import (
    BlockCopy,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    RetentionOwner,
    Tier,
    TierStore,
    entry_key_at,
    hash_blocks,
)

BLOCK = 2


def prompt(tag: int, blocks: int) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BLOCK)]


def tiered(
    device: int, host: int, disk: int = 0, *, share: float = 0.5
) -> tuple[BlockPool, KVCacheManager, ManualClock]:
    clock = ManualClock(0.0)
    lower_disk = TierStore(Tier.DISK, disk, clock=clock, retained_share=share) if disk else None
    host_store = TierStore(Tier.HOST, host, clock=clock, retained_share=share, lower=lower_disk)
    pool = BlockPool(device, BLOCK, retained_share=share, clock=clock, lower=host_store)
    return pool, KVCacheManager(pool), clock


def serve(mgr: KVCacheManager, tokens: list[int], *, ok: bool = True) -> tuple[int, list]:
    """Allocate, run the copies as the engine would, commit and free; (hit tokens, copies)."""
    hs = hash_blocks(tokens, BLOCK)
    alloc = mgr.allocate(hs, len(tokens) + 1)
    copies = mgr.take_copies()
    mgr.finish_copies(copies, ok=ok)
    if not ok:
        alloc.abort()
        return 0, copies
    alloc.commit()
    alloc.free()
    return alloc.num_cached_tokens, copies


def tiers_of(pool: BlockPool, tokens: list[int]) -> list[str | None]:
    out: list[str | None] = []
    for h in hash_blocks(tokens, BLOCK):
        if h in pool.cached:
            out.append("device")
            continue
        found = pool.lower.find(h) if pool.lower is not None else None
        out.append(str(found[0].tier) if found else None)
    return out


def test_evicted_blocks_are_demoted_and_visible_only_after_their_copy() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    mgr.take_events()
    hs_b = hash_blocks(b, BLOCK)
    alloc = mgr.allocate(hs_b, len(b) + 1)  # needs all 3 blocks: evicts a's two
    copies = mgr.take_copies()
    assert [(c.src_tier, c.dst_tier) for c in copies] == [(Tier.DEVICE, Tier.HOST)] * 2
    # In flight: gone from the device, not yet hittable on the host.
    assert tiers_of(pool, a) == [None, None]
    assert mgr.match(hash_blocks(a, BLOCK), len(a) + 1).num_blocks == 0
    mgr.finish_copies(copies, ok=True)
    assert tiers_of(pool, a) == ["host", "host"]
    events = mgr.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.tier is Tier.DEVICE]
    assert set(removed[0].block_hashes) == set(hash_blocks(a, BLOCK))
    assert [e for e in events if isinstance(e, BlockStored) and e.tier is Tier.HOST]
    m = mgr.match(hash_blocks(a, BLOCK), len(a) + 1)
    assert (m.num_blocks, m.lower_blocks) == (2, 2)
    alloc.commit()
    alloc.free()
    pool.check_invariants()


def test_a_host_hit_is_promoted_into_device_blocks_and_counts_as_a_hit() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    serve(mgr, b)  # demotes a
    assert tiers_of(pool, a) == ["host", "host"]
    mgr.take_events()
    hs = hash_blocks(a, BLOCK)
    alloc = mgr.allocate(hs, len(a) + 1)
    assert alloc.num_hit_blocks == 2 and alloc.num_promoted_blocks == 2
    assert alloc.promoted_by_tier == {Tier.HOST: 2}
    copies = mgr.take_copies()
    promotions = [c for c in copies if c.is_promotion]
    assert [c.dst_index for c in promotions] == alloc.block_ids[:2]
    # Demotions out of the blocks being promoted into are queued first.
    first_promotion = copies.index(promotions[0])
    for c in copies[first_promotion:]:
        assert c.is_promotion
    # Until the prefill commits, the host copy stays the one visible place.
    assert tiers_of(pool, a) == ["host", "host"]
    mgr.finish_copies(copies, ok=True)
    alloc.commit()
    assert tiers_of(pool, a) == ["device", "device"]
    events = mgr.take_events()
    assert BlockRemoved((hs[0],), Tier.HOST) in events
    stats = {t.tier: t for t in mgr.stats().tiers}
    assert stats[Tier.HOST].hits == 2 and stats[Tier.HOST].promotions == 2
    assert mgr.stats().hit_tokens == 2 * BLOCK
    alloc.free()
    pool.check_invariants()


def test_an_aborted_promotion_publishes_nothing_and_the_host_keeps_the_blocks() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    serve(mgr, b)
    mgr.take_events()
    hit, copies = serve(mgr, a, ok=False)  # the copy (or the prefill) failed
    assert hit == 0 and any(c.is_promotion for c in copies)
    assert tiers_of(pool, a) == ["host", "host"]
    assert not [
        e for e in mgr.take_events() if isinstance(e, BlockStored) and e.tier is Tier.DEVICE
    ]
    pool.check_invariants()
    # Unpinned: it can still be hit, and evicted again.
    assert serve(mgr, a)[0] == 2 * BLOCK


def test_a_failed_demotion_copy_is_never_published() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    hs_b = hash_blocks(b, BLOCK)
    alloc = mgr.allocate(hs_b, len(b) + 1)
    mgr.finish_copies(mgr.take_copies(), ok=False)
    alloc.abort()
    assert tiers_of(pool, a) == [None, None]
    host = {t.tier: t for t in mgr.stats().tiers}[Tier.HOST]
    assert (host.failed_copies, host.visible, host.used) == (2, 0, 0)
    pool.check_invariants()


def test_a_full_host_tier_pushes_its_oldest_block_to_disk_before_reusing_the_slot() -> None:
    pool, mgr, _ = tiered(device=2, host=1, disk=4)
    a, b, c = prompt(1, 1), prompt(2, 1), prompt(3, 1)
    serve(mgr, a)
    serve(mgr, b)  # device holds a, b (one block each, plus the last-token block)
    serve(mgr, c)
    serve(mgr, prompt(4, 1))
    assert "disk" in tiers_of(pool, a) + tiers_of(pool, b)
    pool.check_invariants()


def test_copy_order_reads_a_host_slot_before_it_is_overwritten() -> None:
    pool, mgr, _ = tiered(device=2, host=1, disk=2)
    a, b = prompt(1, 1), prompt(2, 1)
    serve(mgr, a)  # a's block on device
    hs_b = hash_blocks(b, BLOCK)
    alloc = mgr.allocate(hs_b, len(b) + 1)  # evicts a -> host slot 0
    mgr.finish_copies(mgr.take_copies(), ok=True)
    alloc.commit()
    alloc.free()
    alloc = mgr.allocate(hash_blocks(prompt(3, 1), BLOCK), BLOCK + 1)  # evicts b: host full
    copies = mgr.take_copies()
    assert copies == [
        BlockCopy(hash_blocks(a, BLOCK)[0], Tier.HOST, 0, Tier.DISK, 0),
        BlockCopy(hs_b[0], Tier.DEVICE, copies[1].src_index, Tier.HOST, 0),
    ]
    mgr.finish_copies(copies, ok=True)
    alloc.commit()
    alloc.free()
    assert tiers_of(pool, a) == ["disk"] and tiers_of(pool, b) == ["host"]
    # A disk hit comes straight back to the device.
    assert serve(mgr, a)[0] == BLOCK
    assert {t.tier: t.promotions for t in mgr.stats().tiers}[Tier.DISK] == 1
    pool.check_invariants()


def test_retained_blocks_move_down_under_pressure_and_are_never_dropped() -> None:
    pool, mgr, clock = tiered(device=4, host=4, share=0.5)  # 2 retained per tier
    owner = RetentionOwner("org:a")
    a = prompt(1, 2)
    hs = hash_blocks(a, BLOCK)
    alloc = mgr.allocate(hs, len(a))
    alloc.commit()
    key = entry_key_at(a, len(a), hs, BLOCK, ())
    assert mgr.write_entry(key, len(a), hs, 3600.0, owner).written
    alloc.free()
    # Fill the device with other prompts: a's retained blocks must go down, not away.
    for tag in range(2, 8):
        serve(mgr, prompt(tag, 3))  # the whole device: both retained blocks must move
    assert tiers_of(pool, a) == ["host", "host"]
    host = pool.lower
    assert host is not None and host.retained_by("org:a") == 2
    assert pool.retained_by("org:a") == 0
    # More churn: the host's LRU never takes a retained block.
    for tag in range(10, 30):
        serve(mgr, prompt(tag, 2))
    assert tiers_of(pool, a) == ["host", "host"]
    # The entry still hits, and its refresh extends the retention where the blocks are.
    clock.advance(1800.0)
    hit = mgr.lookup_entry([key])
    assert hit is not None and hit.expires_at == pytest.approx(1800.0 + 3600.0)
    # Promoted back, the retention travels up with the block, charged to the same owner.
    assert serve(mgr, a)[0] == len(a)
    assert tiers_of(pool, a)[0] == "device"
    assert pool.retained_by("org:a") + host.retained_by("org:a") == 2
    pool.check_invariants()
    # After the deadline the blocks are ordinary again.
    clock.advance(3601.0)
    pool.expire()
    host.expire()
    assert pool.retained_by("org:a") + host.retained_by("org:a") == 0
    pool.check_invariants()


def test_a_retained_block_stays_below_when_the_device_retained_share_is_full() -> None:
    pool, mgr, _ = tiered(device=4, host=4, share=0.5)
    host = pool.lower
    assert host is not None
    a = prompt(1, 1)
    h = hash_blocks(a, BLOCK)[0]
    # Put a retained copy of `a` straight into the host tier, then fill the device's share.
    slot = host.reserve(h, Tier.DEVICE, 0, retained_until=100.0, retained_by="org:a")
    assert slot is not None
    mgr.finish_copies(mgr.take_copies(), ok=True)
    for tag in (2, 3):
        b = prompt(tag, 1)
        hb = hash_blocks(b, BLOCK)
        alloc = mgr.allocate(hb, len(b) + 1)
        alloc.commit()
        assert pool.retain(alloc.blocks[:1], 50.0).ok
        alloc.free()
    assert pool.counts().retained == pool.max_retained
    hit, _ = serve(mgr, a)
    assert hit == BLOCK  # the request still reads it (a private copy on the device)
    assert tiers_of(pool, a) == ["host"]  # and the host keeps the retained one
    assert host.retained_by("org:a") == 1
    pool.check_invariants()


def test_recomputing_a_block_on_the_device_drops_its_lower_copy() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    serve(mgr, b)
    assert tiers_of(pool, a) == ["host", "host"]
    # A prompt that misses the first block but shares the second cannot hit it (chain
    # hashes); publishing its own blocks never duplicates a visible hash either way.
    hs = hash_blocks(a, BLOCK)
    host = pool.lower
    assert host is not None
    found = host.find(hs[0])
    assert found is not None
    # A demotion that lands after the device re-published the same hash is dropped.
    serve(mgr, a)  # promoted: now on the device
    slot = host.reserve(hs[0], Tier.DEVICE, 0)
    assert slot is not None
    copies = mgr.take_copies()
    mgr.finish_copies(copies, ok=True)
    assert tiers_of(pool, a)[0] == "device"
    pool.check_invariants()


def test_clear_empties_every_tier_and_voids_copies_in_flight() -> None:
    pool, mgr, _ = tiered(device=3, host=2, disk=2)
    serve(mgr, prompt(1, 2))
    alloc = mgr.allocate(hash_blocks(prompt(2, 2), BLOCK), 2 * BLOCK + 1)
    in_flight = mgr.take_copies()
    assert in_flight
    mgr.clear()
    mgr.finish_copies(in_flight, ok=True)  # lands after the restart: ignored
    assert all(t.visible == 0 and t.used == 0 for t in mgr.stats().tiers)
    alloc.abort()
    pool.check_invariants()


def test_allocation_failure_unpins_and_leaves_everything_as_it_was() -> None:
    pool, mgr, _ = tiered(device=3, host=4)
    a, b = prompt(1, 2), prompt(2, 2)
    serve(mgr, a)
    serve(mgr, b)
    held = mgr.allocate(hash_blocks(prompt(3, 1), BLOCK), BLOCK + 1)  # holds 2 of 3 blocks
    mgr.finish_copies(mgr.take_copies(), ok=True)
    with pytest.raises(PoolExhaustedError):
        mgr.allocate(hash_blocks(a, BLOCK), len(a) + 1)
    pool.check_invariants()
    held.abort()
    assert tiers_of(pool, a) == ["host", "host"]


def test_tier_store_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="positive number of slots"):
        TierStore(Tier.HOST, 0)
    with pytest.raises(ValueError, match="device tier is the BlockPool"):
        TierStore(Tier.DEVICE, 4)
    with pytest.raises(ValueError, match="must be slower"):
        TierStore(Tier.DISK, 4, lower=TierStore(Tier.HOST, 4))
    with pytest.raises(ValueError, match="retained_share"):
        TierStore(Tier.HOST, 4, retained_share=1.5)
    pool, _, _ = tiered(device=2, host=2)
    with pytest.raises(ValueError, match="no disk tier"):
        pool.finish_copies(
            [BlockCopy(hash_blocks([1, 2], BLOCK)[0], Tier.HOST, 0, Tier.DISK, 0)], ok=True
        )


def _entry(mgr: KVCacheManager, tokens: list[int], owner: RetentionOwner, ttl: float = 300.0):
    hs = hash_blocks(tokens, BLOCK)
    alloc = mgr.allocate(hs, len(tokens) + 1)
    mgr.finish_copies(mgr.take_copies(), ok=True)
    alloc.commit()
    key = entry_key_at(tokens, len(tokens), hs, BLOCK, ())
    written = mgr.write_entry(key, len(tokens), hs, ttl, owner)
    alloc.free()
    mgr.finish_copies(mgr.take_copies(), ok=True)
    return key, written


def test_a_full_device_retained_share_moves_older_entries_down_instead_of_refusing() -> None:
    # 16 device blocks, 8 retained at most; the host tier keeps 32 retained.
    clock = ManualClock(0.0)
    host = TierStore(Tier.HOST, 64, clock=clock, retained_share=0.5)
    pool = BlockPool(16, BLOCK, retained_share=0.5, clock=clock, lower=host)
    mgr = KVCacheManager(pool)
    owner = RetentionOwner("org:a")
    keys = []
    for tag in range(6):  # 6 entries of 4 blocks: 24 retained blocks
        clock.advance(1.0)
        key, w = _entry(mgr, prompt(tag, 4), owner)
        assert w.written, w.refused_reason
        keys.append(key)
    assert pool.counts().retained <= pool.max_retained
    assert pool.counts().retained + host.retained_by("org:a") == 24
    # The oldest went down with their TTL, and still hit (and refresh) there.
    assert tiers_of(pool, prompt(0, 4)) == ["host"] * 4
    assert mgr.lookup_entry([keys[0]]) is not None
    pool.check_invariants()


def test_an_owner_at_its_device_quota_moves_its_own_older_entries_down() -> None:
    clock = ManualClock(0.0)
    host = TierStore(Tier.HOST, 64, clock=clock, retained_share=0.5, owner_share=0.5)
    pool = BlockPool(16, BLOCK, retained_share=0.5, owner_share=0.5, clock=clock, lower=host)
    mgr = KVCacheManager(pool)
    a, b = RetentionOwner("org:a"), RetentionOwner("org:b")
    assert pool.owner_quota(a) == 4 and host.owner_quota == 16
    _, wb = _entry(mgr, prompt(9, 4), b)  # b holds its whole device quota
    assert wb.written
    for tag in range(3):
        clock.advance(1.0)
        assert _entry(mgr, prompt(tag, 4), a)[1].written
    # a's older entries moved down; b's stayed where they were.
    assert pool.retained_by("org:a") == 4 and host.retained_by("org:a") == 8
    assert pool.retained_by("org:b") == 4
    # The host tier holds a to its own quota too: past it, a new entry is refused.
    for tag in range(3, 6):
        clock.advance(1.0)
        _entry(mgr, prompt(tag, 4), a)
    assert host.retained_by("org:a") <= host.owner_quota
    pool.check_invariants()
