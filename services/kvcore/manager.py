"""KVCacheManager: the small façade the scheduler drives.

It decides *what* to hit and publish and keeps the managed entries; `BlockPool`
does the mechanics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .allocation import Allocation
from .block import KVBlock
from .copies import BlockCopy
from .entries import CacheEntry, EntryTable
from .events import KVEvent
from .hashing import BlockHash, EntryKey
from .pool import BlockCounts, BlockPool, PoolExhaustedError
from .retention import UNATTRIBUTED, RetainResult, RetentionOwner
from .tier import Tier
from .tier_store import TierSlot, TierStats, TierStore

MAX_LOOKBACK_BOUNDARIES = 20
"""Breakpoint boundaries (content-block ends, one entry key each) a lookup checks
backwards, the breakpoint itself included: boundaries, not hash blocks."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Longest cached prefix of a prompt, without taking references."""

    num_blocks: int  # leading full blocks present in some tier's index
    num_tokens: int  # num_blocks * block_size
    lower_blocks: int = 0  # of num_blocks, those found below the device (to be promoted)


@dataclass(frozen=True, slots=True)
class EntryHit:
    """A live managed entry found for a breakpoint."""

    key: EntryKey  # the entry's key
    num_tokens: int  # prefix length it covers: the billed cache-read position
    ttl: float  # its TTL in seconds
    expires_at: float  # new expiry after the refresh this hit caused
    lookback: int  # boundaries back from the breakpoint; 0 = the breakpoint itself


@dataclass(frozen=True, slots=True)
class EntryWrite:
    """Outcome of writing an entry at a breakpoint."""

    written: bool  # False: retention was refused, so this is billed as plain input
    num_tokens: int  # prefix length asked for
    ttl: float  # TTL asked for
    expires_at: float | None  # None when not written
    refused_reason: str | None = None  # why not, for the client-facing report


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Everything `/v1/stats` and the metrics report about the pool."""

    blocks: BlockCounts  # block states
    entries: int  # live managed entries
    query_tokens: int  # prompt tokens looked up, ever
    hit_tokens: int  # of those, served from cached blocks
    evictions: int  # cached blocks evicted by LRU pressure
    retain_refusals: int  # retains refused by the share cap or an owner's quota
    quota_refusals: int  # of those, refused by the owner's quota
    tiers: tuple[TierStats, ...] = ()  # the lower tiers, fastest first; empty without any


class KVCacheManager:
    """Prefix hits, allocation transactions and TTL entries over one `BlockPool`."""

    def __init__(self, pool: BlockPool, *, max_lookback: int = MAX_LOOKBACK_BOUNDARIES) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_lookback = max_lookback
        self.entries = EntryTable()
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---------------------------------------------------------------- prefix

    def match(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> PrefixMatch:
        """Longest usable cached prefix; never the block holding the last token.

        NOTE: the last prompt token must go through the model to produce the logits
        of the first output token, so a fully cached prompt still recomputes its
        last block.
        """
        usable = min(len(block_hashes), max(num_tokens - 1, 0) // self.block_size)
        n = len(self.pool.match_prefix(block_hashes, usable))
        below = len(self.pool.match_lower(block_hashes[n:usable]))
        total = n + below
        return PrefixMatch(num_blocks=total, num_tokens=total * self.block_size, lower_blocks=below)

    def allocate(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> Allocation:
        """Hit the longest cached prefix and allocate blocks for the rest.

        Raises `PoolExhaustedError` with the pool untouched when it cannot fit.
        """
        if num_tokens <= 0:
            raise ValueError("num_tokens must be positive")
        if len(block_hashes) > num_tokens // self.block_size:
            raise ValueError("more block hashes than full blocks in num_tokens")
        pool = self.pool
        usable = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        hits = pool.match_prefix(block_hashes, usable)
        below = pool.match_lower(block_hashes[len(hits) : usable])
        # NOTE: take refs on the hits and pin the lower-tier ones first, so our own
        # allocation can neither evict the first nor reuse the slots of the second.
        pool.touch(hits)
        for store, slot in below:
            store.pin(slot)
        need = -(-num_tokens // self.block_size) - len(hits)
        try:
            new = pool.allocate(need)
        except PoolExhaustedError:
            for store, slot in below:
                store.unpin(slot)
            pool.free(reversed(hits))
            raise
        # NOTE: queued after any demotion that `allocate` just queued out of these same
        # blocks, so the engine reads a block's old bytes out before promoting in.
        promoted: dict[Tier, int] = {}
        for (store, slot), block in zip(below, new, strict=False):
            h = slot.block_hash
            assert h is not None
            pool.queue_copy(BlockCopy(h, store.tier, slot.index, Tier.DEVICE, block.block_id))
            promoted[store.tier] = promoted.get(store.tier, 0) + 1
            store.num_hits += 1
        num_hit = len(hits) + len(below)
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit * self.block_size
        return Allocation(
            pool,
            hits + new,
            num_hit,
            block_hashes,
            num_tokens,
            num_published=len(hits),
            pins=below,
            promoted_by_tier=promoted,
        )

    # --------------------------------------------------------------- entries

    def lookup_entry(self, candidates: Sequence[EntryKey]) -> EntryHit | None:
        """First live entry among ``candidates`` (breakpoint first, then backwards).

        The candidates are the entry keys at the breakpoint and at the content-block
        boundaries before it; only the first `max_lookback` are checked. A hit
        refreshes the entry and its blocks' retention.
        """
        now = self.pool.clock()
        self.entries.expire(now)
        for lookback, key in enumerate(candidates[: self.max_lookback]):
            entry = self.entries.get_live(key, now)
            if entry is None:
                continue
            located = self._resident(entry.block_hashes)
            if located is None:
                self.entries.drop(entry)  # its blocks were cleared under it
                continue
            # NOTE: a live entry's blocks are retained at least as long as it lives, so
            # this only moves deadlines; it charges nothing new (blocks stay charged to
            # whoever retained them first, here or through another entry), in
            # whichever tier each block lives now.
            self._retain(located, entry.ttl, entry.owner)
            self.entries.extend(entry, now + entry.ttl)
            return EntryHit(entry.key, entry.num_tokens, entry.ttl, entry.expires_at, lookback)
        return None

    def write_entry(
        self,
        key: EntryKey,
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        ttl: float,
        owner: RetentionOwner | None = None,
    ) -> EntryWrite:
        """Write (or extend) the entry for a breakpoint and retain its full blocks.

        ``block_hashes`` are the prompt's chain hashes; the entry covers the first
        ``num_tokens // block_size`` of them, which must be published already. Blocks
        not retained yet are charged to ``owner`` (refused past its quota).
        """
        full = num_tokens // self.block_size
        if full > len(block_hashes):
            raise ValueError("block_hashes do not cover num_tokens")
        covered = tuple(block_hashes[:full])
        located = self._resident(covered)
        if located is None:
            return EntryWrite(False, num_tokens, ttl, None, "prefix blocks are not resident")
        now = self.pool.clock()
        entry = self.entries.get_live(key, now)
        # NOTE: an entry keeps its longest TTL, so its blocks must be retained that long
        # too: a live entry over unretained blocks could lose them to LRU.
        keep = ttl if entry is None else max(ttl, entry.ttl)
        result = self._retain(located, keep, owner)
        if not result.ok:
            return EntryWrite(False, num_tokens, ttl, None, result.reason)
        if entry is None:
            entry = CacheEntry(key, num_tokens, covered, ttl, now + ttl, owner)
            self.entries.put(entry)
        else:
            entry.ttl = max(entry.ttl, ttl)
            self.entries.extend(entry, now + entry.ttl)
        return EntryWrite(True, num_tokens, ttl, entry.expires_at)

    def _resident(self, block_hashes: Sequence[BlockHash]) -> Located | None:
        """Where each block lives now (device blocks, and slots per lower tier)."""
        located = Located()
        lower = self.pool.lower
        for h in block_hashes:
            block = self.pool.get_cached(h)
            if block is not None:
                located.device.append(block)
                continue
            found = lower.find(h) if lower is not None else None
            if found is None:
                return None
            store, slot = found
            located.lower.setdefault(store.tier, (store, []))[1].append(slot)
        return located

    def _retain(self, located: Located, ttl: float, owner: RetentionOwner | None) -> RetainResult:
        """Retain an entry's blocks in the tiers that hold them.

        NOTE: all or nothing per tier, device first. A lower tier refusing after the
        device accepted leaves the device blocks retained (over-retention, never a
        lapse) and reports the refusal, so the entry is not written.
        """
        result = self.pool.retain(located.device, ttl, owner)
        if not result.ok or not located.lower:
            return result
        key = (owner or UNATTRIBUTED).key
        for store, slots in located.lower.values():
            if not store.retain(slots, result.retained_until, key):
                return RetainResult.refused(
                    f"retained share cap of the {store.tier} tier: {store.max_retained} "
                    "blocks retained",
                    result.retained_until,
                )
        return result

    # ----------------------------------------------------------------- misc

    def clear(self) -> None:
        """Drop every cached block and entry (a restart starts a new epoch with this)."""
        self.pool.clear()
        self.entries.clear()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def take_copies(self) -> list[BlockCopy]:
        """Tier copies to run before the next forward, in order (see `BlockCopy`)."""
        return self.pool.take_copies()

    def finish_copies(self, copies: Sequence[BlockCopy], ok: bool) -> None:
        """Report the engine ran ``copies`` (ok) or failed them: publish or drop demotions."""
        self.pool.finish_copies(copies, ok)

    def stats(self) -> CacheStats:
        self.entries.expire(self.pool.clock())
        return CacheStats(
            blocks=self.pool.counts(),
            entries=len(self.entries),
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            evictions=self.pool.num_evictions,
            retain_refusals=self.pool.num_retain_refusals,
            quota_refusals=self.pool.num_quota_refusals,
            tiers=tuple(self.pool.tier_stats()),
        )


@dataclass(slots=True)
class Located:
    """An entry's blocks, by the tier that holds each now."""

    device: list[KVBlock] = field(default_factory=list)  # blocks in the device pool
    lower: dict[Tier, tuple[TierStore, list[TierSlot]]] = field(default_factory=dict)
