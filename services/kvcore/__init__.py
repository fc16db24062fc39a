"""kvcore: chained block hashing, the block pool, TTL retention and the prefix index.

Pure Python with no I/O, shared by the replica scheduler and the gateway's router.
It imports nothing else of Cachepoint's.
"""

from .allocation import Allocation, AllocationError, AllocationState
from .block import KVBlock
from .clock import Clock, ManualClock, monotonic_clock
from .copies import BlockCopy
from .entries import CacheEntry
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .eviction import (
    DEFAULT_EVICTION,
    EVICTION_POLICIES,
    BlockPriority,
    EvictionPolicy,
    FreeQueue,
    LRUEviction,
    PriorityFreeQueue,
    ReuseCreditEviction,
    ReuseCreditQueue,
    SegmentedFreeQueue,
    SegmentedLRUEviction,
)
from .eviction_density import HitDensityEviction, HitDensityQueue, ReuseHistogram
from .free_queue import FreeBlockQueue
from .hashing import (
    ROOT_HASH,
    BlockHash,
    EntryKey,
    ExtraKeys,
    KeySpan,
    encode_tokens,
    entry_key,
    entry_key_at,
    hash_block,
    hash_blocks,
)
from .manager import (
    MAX_LOOKBACK_BOUNDARIES,
    CacheStats,
    EntryHit,
    EntryWrite,
    KVCacheManager,
    PrefixMatch,
)
from .pin_ledger import PinLedger, PinStats
from .pool import BlockCounts, BlockPool, PoolExhaustedError
from .prefix_index import PrefixIndex, TierMatch
from .retention import (
    TTL_1H,
    TTL_5M,
    TTL_24H,
    TTL_SECONDS,
    UNATTRIBUTED,
    RetainResult,
    RetentionOwner,
)
from .tier import TIER_ORDER, Tier
from .tier_store import SlotState, TierSlot, TierStats, TierStore

__all__ = [
    "DEFAULT_EVICTION",
    "EVICTION_POLICIES",
    "MAX_LOOKBACK_BOUNDARIES",
    "ROOT_HASH",
    "TIER_ORDER",
    "TTL_1H",
    "TTL_5M",
    "TTL_24H",
    "TTL_SECONDS",
    "UNATTRIBUTED",
    "AllBlocksCleared",
    "Allocation",
    "AllocationError",
    "AllocationState",
    "BlockCopy",
    "BlockCounts",
    "BlockHash",
    "BlockPool",
    "BlockPriority",
    "BlockRemoved",
    "BlockStored",
    "CacheEntry",
    "CacheStats",
    "Clock",
    "EntryHit",
    "EntryKey",
    "EntryWrite",
    "EvictionPolicy",
    "ExtraKeys",
    "FreeBlockQueue",
    "FreeQueue",
    "HitDensityEviction",
    "HitDensityQueue",
    "KVBlock",
    "KVCacheManager",
    "KVEvent",
    "KeySpan",
    "LRUEviction",
    "ManualClock",
    "PinLedger",
    "PinStats",
    "PoolExhaustedError",
    "PrefixIndex",
    "PrefixMatch",
    "PriorityFreeQueue",
    "RetainResult",
    "RetentionOwner",
    "ReuseCreditEviction",
    "ReuseCreditQueue",
    "ReuseHistogram",
    "SegmentedFreeQueue",
    "SegmentedLRUEviction",
    "SlotState",
    "Tier",
    "TierMatch",
    "TierSlot",
    "TierStats",
    "TierStore",
    "encode_tokens",
    "entry_key",
    "entry_key_at",
    "hash_block",
    "hash_blocks",
    "monotonic_clock",
]
