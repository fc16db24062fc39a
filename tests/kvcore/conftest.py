from __future__ import annotations

import pytest

from cachepoint.kvcore import BlockPool, KVCacheManager, ManualClock

BLOCK = 4


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


@pytest.fixture
def pool(clock: ManualClock) -> BlockPool:
    return BlockPool(8, BLOCK, retained_share=0.5, clock=clock)


@pytest.fixture
def manager(pool: BlockPool) -> KVCacheManager:
    return KVCacheManager(pool)
