"""A mirror of another engine's prefix cache, in kvcore's hash space.

An engine that keeps its own pool (vLLM) reports what it caches as events keyed by its
own block hashes: a run of blocks stored under a parent, with their tokens; blocks
removed; everything cleared. `PoolMirror` replays those events and translates each
foreign hash into the kvcore chain hash of the same prefix, so the router and the
snapshots see that engine's blocks exactly as they see a kvcore pool's, and it emits
kvcore `KVEvent`s for the bus.

`MirrorCacheManager` adds the managed entries on top: TTL entries that are read only
when the engine itself reports it reused their blocks: a mirror cannot pin a block the
engine is free to evict. (On vLLM a connector pins them, as `PinLedger` decides;
entries still lapse here if it did not.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from .clock import Clock, monotonic_clock
from .entries import CacheEntry, EntryTable
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .hashing import ROOT_HASH, BlockHash, EntryKey, ExtraKeys, hash_blocks

ForeignHash = Hashable
"""A block hash in the mirrored engine's own space (vLLM: bytes or int)."""


@dataclass(slots=True, frozen=True)
class Translation:
    """What one foreign block is in kvcore's space. Fixed for the foreign hash's life:
    a chained hash names its whole prefix, so the same hash always means the same one."""

    block_hash: BlockHash  # kvcore chain hash of the same prefix
    extra_keys: ExtraKeys  # the extra keys its chain is hashed under (children inherit)


class PoolMirror:
    """Which blocks a foreign engine caches, translated into kvcore chain hashes.

    NOTE: translations outlive the blocks (a bounded LRU), because an engine may evict
    a parent while a child stays, then store a child under that parent later: without
    the parent's translation the child could not be placed in kvcore's chain.
    """

    __slots__ = (
        "_events",
        "_present",
        "_refs",
        "_translations",
        "block_size",
        "max_translations",
        "num_unmapped",
    )

    def __init__(self, block_size: int, *, max_translations: int = 1 << 20) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.max_translations = max_translations  # foreign hashes remembered, present or not
        self.num_unmapped = 0  # stored blocks dropped: their parent was never seen
        self._translations: OrderedDict[ForeignHash, Translation] = OrderedDict()
        self._present: set[ForeignHash] = set()  # foreign hashes cached now
        # NOTE: refcounts on our hashes: two foreign blocks can name one kvcore block (the
        # engine keyed something we do not, e.g. a LoRA), and it stays until both go.
        self._refs: dict[BlockHash, int] = {}
        self._events: list[KVEvent] = []

    # ---------------------------------------------------------------- events in

    def stored(
        self,
        parent: ForeignHash | None,
        hashes: Sequence[ForeignHash],
        tokens: Sequence[int],
        root_keys: ExtraKeys = (),
    ) -> int:
        """A run of full blocks became cached: ``hashes[i]`` holds
        ``tokens[i*B:(i+1)*B]`` and chains onto ``parent`` (None: the first block).

        ``root_keys`` are the extra keys of a run that starts at the root; a run under a
        parent inherits the parent's. Blocks already present are ignored (engines repeat
        stored events for reused blocks). Returns the blocks newly mirrored.
        """
        b = self.block_size
        if len(tokens) != len(hashes) * b:
            raise ValueError(f"{len(hashes)} blocks need {len(hashes) * b} tokens: {len(tokens)}")
        if parent is None:
            prev, keys = ROOT_HASH, tuple(root_keys)
        else:
            known = self._translations.get(parent)
            if known is None:
                self.num_unmapped += len(hashes)
                return 0
            prev, keys = known.block_hash, known.extra_keys
        ours = hash_blocks(tokens, b, keys, parent=prev)
        run: list[BlockHash] = []
        run_parent: BlockHash | None = None
        added = 0
        for foreign, block_hash in zip(hashes, ours, strict=True):
            self._remember(foreign, Translation(block_hash, keys))
            fresh = foreign not in self._present
            if fresh:
                self._present.add(foreign)
                n = self._refs.get(block_hash, 0)
                self._refs[block_hash] = n + 1
                fresh = n == 0
            if fresh:
                if not run:
                    run_parent = None if prev == ROOT_HASH else prev
                run.append(block_hash)
                added += 1
            else:
                self._flush_run(run, run_parent)
                run = []
            prev = block_hash
        self._flush_run(run, run_parent)
        return added

    def removed(self, hashes: Sequence[ForeignHash]) -> list[BlockHash]:
        """Blocks left the engine's cache; returns the kvcore hashes that are gone.
        Unknown or absent hashes are ignored."""
        gone: list[BlockHash] = []
        for foreign in hashes:
            if foreign not in self._present:
                continue
            self._present.discard(foreign)
            ours = self._translations[foreign].block_hash
            n = self._refs[ours] - 1
            if n:
                self._refs[ours] = n
            else:
                del self._refs[ours]
                gone.append(ours)
        if gone:
            self._events.append(BlockRemoved(tuple(gone)))
        return gone

    def cleared(self) -> None:
        """The engine dropped its whole cache (or restarted)."""
        self._present.clear()
        self._refs.clear()
        self._translations.clear()
        self._events.append(AllBlocksCleared())

    # --------------------------------------------------------------- reading

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def cached(self) -> Iterator[BlockHash]:
        """Every kvcore hash the engine holds now (a snapshot's content)."""
        return iter(list(self._refs))

    def translate(self, foreign: ForeignHash) -> BlockHash | None:
        known = self._translations.get(foreign)
        return None if known is None else known.block_hash

    # ------------------------------------------------------------- internals

    def _remember(self, foreign: ForeignHash, translation: Translation) -> None:
        table = self._translations
        table[foreign] = translation
        table.move_to_end(foreign)
        while len(table) > self.max_translations:
            oldest = next(iter(table))
            if oldest in self._present:
                # NOTE: never forget a present block's translation (its removal must map);
                # a full table of present blocks just grows past the bound.
                table.move_to_end(oldest)
                break
            del table[oldest]

    def _flush_run(self, run: list[BlockHash], parent: BlockHash | None) -> None:
        if run:
            self._events.append(BlockStored(tuple(run), parent))


@dataclass(frozen=True, slots=True)
class MirrorEntryHit:
    """A live entry whose blocks the engine reported it reused."""

    key: EntryKey  # the entry's key
    num_tokens: int  # prefix length it covers: the billed cache-read position
    lookback: int  # boundaries back from the breakpoint; 0 = the breakpoint itself


@dataclass(frozen=True, slots=True)
class MirrorStats:
    """What `/v1/stats` reports of a mirrored pool."""

    cached_blocks: int  # blocks the engine holds in its prefix cache now
    entries: int  # live managed entries
    lapsed_entries: int  # entries whose blocks the engine evicted before their TTL, ever
    query_tokens: int  # prompt tokens looked up, ever
    hit_tokens: int  # of those, reused by the engine
    unmapped_blocks: int  # stored blocks that could not be placed (parent never seen)


class MirrorCacheManager:
    """Managed TTL entries over a `PoolMirror`: the KVCacheManager of a foreign engine.

    An entry is read only when the engine itself reused at least the blocks it covers
    (or every block the prompt's last token leaves usable), so a read is never billed
    for KV that was recomputed. Entries cannot pin blocks: the engine evicts by its own
    policy, and an entry whose blocks go is dropped (counted as a lapse).
    """

    def __init__(self, mirror: PoolMirror, *, clock: Clock = monotonic_clock) -> None:
        self.mirror = mirror
        self.block_size = mirror.block_size
        self.clock = clock
        self.entries = EntryTable()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.lapsed_entries = 0
        # NOTE: entries by their last full block, so an eviction finds what it ends in
        # O(blocks removed): an engine evicts a chain from its tail first, and a prefix
        # that lost its last block can no longer be reused whole.
        self._by_last: dict[BlockHash, list[CacheEntry]] = {}

    def lookup_entry(
        self, candidates: Sequence[EntryKey], engine_hit_tokens: int, prompt_tokens: int
    ) -> MirrorEntryHit | None:
        """First live entry among ``candidates`` (breakpoint first, then backwards) whose
        blocks the engine reused for this prompt. A hit refreshes its TTL."""
        now = self.clock()
        self.entries.expire(now)
        hit_blocks = engine_hit_tokens // self.block_size
        # NOTE: an engine never reuses the block that holds the last prompt token (its
        # logits are needed), so an entry covering the whole prompt is read once every
        # block before that one was reused.
        usable = max(prompt_tokens - 1, 0) // self.block_size
        for lookback, key in enumerate(candidates):
            entry = self.entries.get_live(key, now)
            if entry is None:
                continue
            if hit_blocks < min(len(entry.block_hashes), usable):
                continue  # the engine recomputed part of it: not a read
            self.entries.extend(entry, now + entry.ttl)
            return MirrorEntryHit(entry.key, entry.num_tokens, lookback)
        return None

    def write_entry(
        self, key: EntryKey, num_tokens: int, block_hashes: Sequence[BlockHash], ttl: float
    ) -> float:
        """Write (or extend) the entry for a breakpoint; returns its expiry. The engine
        has just computed or reused every block under it, so they are cached now."""
        full = num_tokens // self.block_size
        if full > len(block_hashes):
            raise ValueError("block_hashes do not cover num_tokens")
        now = self.clock()
        entry = self.entries.get_live(key, now)
        if entry is None:
            entry = CacheEntry(key, num_tokens, tuple(block_hashes[:full]), ttl, now + ttl)
            self.entries.put(entry)
            if entry.block_hashes:
                # NOTE: expired entries are pruned here, so one block's list holds at
                # most its live entries and the new one, whatever the rewrites.
                last = entry.block_hashes[-1]
                live = [e for e in self._by_last.get(last, ()) if e.expires_at > now]
                self._by_last[last] = [*live, entry]
        else:
            entry.ttl = max(entry.ttl, ttl)
            self.entries.extend(entry, now + entry.ttl)
        return entry.expires_at

    def count_query(self, prompt_tokens: int, engine_hit_tokens: int) -> None:
        self.query_tokens += prompt_tokens
        self.hit_tokens += engine_hit_tokens

    def lapse(self, removed: Sequence[BlockHash]) -> int:
        """The engine evicted ``removed``: drop the live entries that ended in one of
        them (they can no longer be read); returns how many."""
        now = self.clock()
        dropped = 0
        for block_hash in removed:
            for entry in self._by_last.pop(block_hash, ()):
                if self.entries.get_live(entry.key, now) is entry:
                    self.entries.drop(entry)
                    dropped += 1
        self.lapsed_entries += dropped
        return dropped

    def lapse_all(self) -> int:
        """The engine's cache is gone (or unknown): every live entry lapses."""
        dropped = len(self.entries)
        self.entries.clear()
        self._by_last.clear()
        self.lapsed_entries += dropped
        return dropped

    def clear(self) -> None:
        self.mirror.cleared()
        self.entries.clear()
        self._by_last.clear()

    def stats(self) -> MirrorStats:
        self.entries.expire(self.clock())
        return MirrorStats(
            cached_blocks=len(self.mirror),
            entries=len(self.entries),
            lapsed_entries=self.lapsed_entries,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            unmapped_blocks=self.mirror.num_unmapped,
        )
