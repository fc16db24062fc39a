from __future__ import annotations

import pytest

from cachepoint.kvcore import (
    AllBlocksCleared,
    BlockPool,
    KVCacheManager,
    ManualClock,
    PrefixIndex,
    hash_blocks,
)


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
