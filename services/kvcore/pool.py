"""BlockPool: the mechanics of a replica's KV blocks (states, LRU, index, TTL, events).

Policy (which prefix to hit, what to publish, when to write an entry) lives in
`KVCacheManager`; this class only moves blocks between states and keeps its
counters exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .block import KVBlock
from .clock import Clock, monotonic_clock
from .copies import BlockCopy
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .eviction import EvictionPolicy, FreeQueue, LRUEviction
from .hashing import BlockHash
from .retention import UNATTRIBUTED, DeadlineHeap, RetainResult, RetentionOwner, owner_quota
from .tier import Tier
from .tier_store import TierSlot, TierStats, TierStore


class PoolExhaustedError(RuntimeError):
    """Not enough free blocks: every block is active or retained."""


@dataclass(frozen=True, slots=True)
class BlockCounts:
    """A consistent snapshot of block states; active + cached_free + empty == total."""

    total: int  # blocks in the pool
    active: int  # ref_cnt > 0
    cached_free: int  # ref_cnt == 0, in the hash index (hittable, evictable unless retained)
    empty: int  # ref_cnt == 0, not in the index
    retained: int  # TTL-retained right now, whether active or cached-free (overlaps the above)
    max_retained: int  # cap on `retained` from the configured share
    retained_owners: int = 0  # owners holding at least one retained block


class BlockPool:
    """Fixed set of `KVBlock`s.

    Invariants, checked by `check_invariants` in tests:
      - an active block is never in the free queue;
      - an empty block is always in the free queue;
      - a cached-free block is in the free queue iff it is not retained ("parked"
        otherwise), so LRU eviction can never take a retained block;
      - ``cached[h].block_hash == h`` for every indexed hash;
      - every retained block is charged to exactly one owner, so the per-owner counts
        sum to the retained count.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        retained_share: float = 0.5,
        owner_share: float = 1.0,
        clock: Clock = monotonic_clock,
        eviction: EvictionPolicy | None = None,
        lower: TierStore | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if not 0.0 <= retained_share <= 1.0:
            raise ValueError("retained_share must be within [0, 1]")
        if not 0.0 <= owner_share <= 1.0:
            raise ValueError("owner_share must be within [0, 1]")
        self.block_size = block_size
        self.clock = clock
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.eviction: EvictionPolicy = eviction or LRUEviction()
        self.free_queue: FreeQueue = self.eviction.make_queue(self.blocks, clock)
        self.cached: dict[BlockHash, KVBlock] = {}  # the hash index
        self.max_retained = int(retained_share * num_blocks)
        self.owner_share = owner_share  # default share of max_retained one owner may hold
        self.num_evictions = 0  # cached blocks evicted by LRU pressure, ever
        self.num_retain_refusals = 0  # retain calls refused (share cap or owner quota), ever
        self.num_quota_refusals = 0  # of those, refused by the owner's quota
        self._events: list[KVEvent] = []
        self._retain_deadlines: DeadlineHeap[KVBlock] = DeadlineHeap()
        self._num_active = 0
        self._num_cached_free = 0
        self._num_retained = 0
        self._owned: dict[str, int] = {}  # owner key -> retained blocks charged to it (> 0)
        self._copies: list[BlockCopy] = []  # queued tier copies, in the order they must run
        self.num_retained_demotions = 0  # retained blocks moved down to make room, ever
        # NOTE: the tiers below share this pool's event and copy logs (drained in place,
        # never rebound), so one ordered stream covers the whole hierarchy.
        self.lower = lower  # the host tier (and the disk tier below it), if any
        if lower is not None:
            lower.bind(self._events, self._copies, self.cached.__contains__)

    # ---------------------------------------------------------------- lookup

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the hash index (in use or cached-free): an upper bound of any hit."""
        return len(self.cached)

    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[KVBlock]:
        """Cached blocks for the longest leading run of ``block_hashes`` (at most max_blocks)."""
        hits: list[KVBlock] = []
        cached = self.cached
        for h in block_hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def match_lower(self, block_hashes: Sequence[BlockHash]) -> list[tuple[TierStore, TierSlot]]:
        """Lower-tier slots for the longest leading run of ``block_hashes`` found below."""
        lower = self.lower
        if lower is None:
            return []
        hits: list[tuple[TierStore, TierSlot]] = []
        for h in block_hashes:
            found = lower.find(h)
            if found is None:
                break
            hits.append(found)
        return hits

    # ----------------------------------------------------------- ref counting

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on hit blocks, pulling cached-free ones out of the LRU queue."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise ValueError(f"block {block.block_id} is empty; only cached blocks are hit")
                if block.prev_free is not None:
                    queue.remove(block)
                self._num_cached_free -= 1
                self._num_active += 1
            block.ref_cnt += 1
            block.hits += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the LRU head, evicting cached-free ones as needed."""
        if n <= 0:
            return []
        self.expire()
        if n > len(self.free_queue) and self.lower is not None:
            self._demote_retained(n - len(self.free_queue))
        if n > len(self.free_queue):
            raise PoolExhaustedError(
                f"need {n} free blocks, have {len(self.free_queue)} "
                f"({self._num_active} active, {self._num_retained} retained)"
            )
        out = self.free_queue.popleft_n(n)
        evicted: list[BlockHash] = []
        for block in out:
            h = block.block_hash
            if h is not None:
                # NOTE: eviction only forgets host metadata; the device memory is
                # simply overwritten by the next prefill, never zeroed.
                del self.cached[h]
                block.block_hash = None
                evicted.append(h)
                self._num_cached_free -= 1
                if self.lower is not None:
                    # NOTE: reserved before anything is written to the block: its copy
                    # down is queued ahead of whatever will fill the block next.
                    self.lower.reserve(h, Tier.DEVICE, block.block_id)
            block.ref_cnt = 1
            block.hits = 0
        self._num_active += n
        if evicted:
            self.num_evictions += len(evicted)
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def _demote_retained(self, short: int, *, owner: str | None = None) -> int:
        """Move up to ``short`` retained cached-free blocks (only ``owner``'s, if given)
        down a tier, freeing their blocks and their share of the retained budget.
        Returns how many moved.

        NOTE: a TTL sold for an hour must not pin device memory for an hour: under
        pressure the retention travels down with the block (earliest deadline first,
        the least recently refreshed), charged to the same owner in the lower tier.
        """
        lower = self.lower
        assert lower is not None
        parked = [
            b
            for b in self.cached.values()
            if b.ref_cnt == 0 and b.retained_until > 0.0 and owner in (None, b.retained_by)
        ]
        parked.sort(key=lambda b: b.retained_until)
        removed: list[BlockHash] = []
        for block in parked[:short]:
            if not lower.can_accept_retained(block.retained_by):
                break
            h = block.block_hash
            owner = block.retained_by
            assert h is not None and owner is not None
            slot = lower.reserve(
                h,
                Tier.DEVICE,
                block.block_id,
                retained_until=block.retained_until,
                retained_by=owner,
            )
            if slot is None:
                break
            block.retained_until = 0.0
            self._uncharge(block)
            self._num_retained -= 1
            del self.cached[h]
            block.block_hash = None
            self._num_cached_free -= 1
            self.free_queue.appendleft(block)
            removed.append(h)
        if removed:
            self.num_retained_demotions += len(removed)
            self._events.append(BlockRemoved(tuple(removed)))
        return len(removed)

    def free(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        Callers pass a request's blocks in reverse, so a chain's tail reaches the
        queue first and is evicted before the prefix that other requests share.
        """
        queue = self.free_queue
        self.expire()
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            self._num_active -= 1
            if block.block_hash is None:
                # NOTE: empty blocks go to the head so allocation reuses them before
                # it has to evict anything that could still be hit.
                queue.appendleft(block)
            else:
                self._num_cached_free += 1
                if block.retained_until == 0.0:
                    queue.append(block)

    # ------------------------------------------------------------- publishing

    def publish(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
    ) -> int:
        """Enter freshly filled blocks into the index; emit `stored` per contiguous run.

        A hash that is already indexed (another request filled the same prefix
        concurrently) is skipped: that block stays unindexed and is reused as empty
        once freed. Returns how many blocks were entered.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError("one hash per block")
        cached = self.cached
        run: list[BlockHash] = []
        run_parent = parent_hash
        stored = 0
        prev = parent_hash
        for block, h in zip(blocks, block_hashes, strict=True):
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is not held; publish before free")
            if block.block_hash is None and h not in cached and self._claim_from_lower(block, h):
                block.block_hash = h
                cached[h] = block
                if not run:
                    run_parent = prev
                run.append(h)
                stored += 1
            elif run:
                self._events.append(BlockStored(tuple(run), run_parent))
                run = []
            prev = h
        if run:
            self._events.append(BlockStored(tuple(run), run_parent))
        return stored

    def _claim_from_lower(self, block: KVBlock, h: BlockHash) -> bool:
        """Before ``h`` is published on the device, take it out of the tier below.

        A hash is hittable in one place only. A retained block keeps its retention on
        the way up; False (publish nothing, the lower tier keeps it) when the device's
        retained share is full, so the TTL guarantee never lapses in transit.
        """
        if self.lower is None:
            return True
        found = self.lower.find(h)
        if found is None:
            return True
        store, slot = found
        if slot.retained_until > 0.0:
            if self._num_retained >= self.max_retained:
                return False
            owner = slot.retained_by
            assert owner is not None
            block.retained_until = slot.retained_until
            block.retained_by = owner
            self._retain_deadlines.push(block.retained_until, block)
            self._owned[owner] = self._owned.get(owner, 0) + 1
            self._num_retained += 1
        store.take(slot, promoted=slot.pins > 0)
        return True

    # -------------------------------------------------------------- retention

    def owner_quota(self, owner: RetentionOwner) -> int:
        """Retained blocks ``owner`` may hold: its share (or the pool's) of the cap, floored."""
        return owner_quota(owner, self.owner_share, self.max_retained)

    def retained_by(self, owner_key: str) -> int:
        """Retained blocks charged to ``owner_key`` right now."""
        self.expire()
        return self._owned.get(owner_key, 0)

    def retained_owners(self) -> dict[str, int]:
        """Retained blocks per owner key (owners holding none are absent)."""
        self.expire()
        return dict(self._owned)

    def retain(
        self, blocks: Sequence[KVBlock], ttl: float, owner: RetentionOwner | None = None
    ) -> RetainResult:
        """Retain indexed blocks until ``now + ttl``; never shortens a longer retention.

        All or nothing: a retain that would push the retained count past the cap, or
        push ``owner`` past its quota, is refused whole and changes nothing. Only blocks
        not yet retained count against either; they are charged to ``owner`` until
        they expire. A block someone else already retains stays charged to them.
        """
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        now = self.clock()
        self.expire(now)
        deadline = now + ttl
        fresh: dict[int, KVBlock] = {}
        for block in blocks:
            if block.block_hash is None:
                raise ValueError(f"block {block.block_id} is not indexed; it cannot be retained")
            if block.retained_until == 0.0:
                fresh[block.block_id] = block
        owner = owner or UNATTRIBUTED
        held = self._owned.get(owner.key, 0)
        quota = self.owner_quota(owner)
        # NOTE: a quota equal to the cap is no per-owner limit; the cap check below
        # then gives the truer reason. An owner at its quota never reclaims its own
        # older retentions: a TTL already sold is a guarantee, so the new one is refused.
        over_quota = quota < self.max_retained and held + len(fresh) > quota
        if fresh and over_quota and self.lower is not None:
            # NOTE: the owner's older retained blocks keep their TTL one tier down, which
            # makes room for the new one here (the lower tier applies its own quota).
            self._demote_retained(held + len(fresh) - quota, owner=owner.key)
            held = self._owned.get(owner.key, 0)
            over_quota = held + len(fresh) > quota
        if fresh and over_quota:
            self.num_retain_refusals += 1
            self.num_quota_refusals += 1
            return RetainResult.refused(
                f"tenant retention quota: {held} of {quota} blocks retained, "
                f"{len(fresh)} more requested",
                deadline,
            )
        if self._num_retained + len(fresh) > self.max_retained and self.lower is not None:
            self._demote_retained(self._num_retained + len(fresh) - self.max_retained)
            held = self._owned.get(owner.key, 0)  # it may have moved some of the owner's
        if self._num_retained + len(fresh) > self.max_retained:
            self.num_retain_refusals += 1
            return RetainResult.refused(
                f"retained share cap: {self._num_retained} of {self.max_retained} blocks "
                f"retained, {len(fresh)} more requested",
                deadline,
            )
        queue = self.free_queue
        for block in blocks:
            if deadline <= block.retained_until:
                continue
            block.retained_until = deadline
            self._retain_deadlines.push(deadline, block)
            if block.prev_free is not None:
                queue.remove(block)  # parked: out of LRU reach until it expires
        for block in fresh.values():
            block.retained_by = owner.key
        if fresh:
            self._owned[owner.key] = held + len(fresh)
        self._num_retained += len(fresh)
        return RetainResult(ok=True, newly_retained=len(fresh), retained_until=deadline)

    def expire(self, now: float | None = None) -> int:
        """Release retentions that are due; returns how many blocks were released."""
        if now is None:
            now = self.clock()
        released = 0
        queue = self.free_queue
        for deadline, block in self._retain_deadlines.pop_due(now):
            if block.retained_until != deadline:
                continue  # stale: refreshed to a later deadline since, or cleared
            block.retained_until = 0.0
            self._uncharge(block)
            released += 1
            if block.ref_cnt == 0 and block.block_hash is not None and block.prev_free is None:
                # NOTE: its last use was at least a TTL ago, older than anything the
                # LRU queue holds, so it goes to the head and is evicted first.
                queue.appendleft(block)
        self._num_retained -= released
        return released

    def _uncharge(self, block: KVBlock) -> None:
        key = block.retained_by
        if key is None:
            raise AssertionError(f"retained block {block.block_id} is charged to no owner")
        block.retained_by = None
        left = self._owned[key] - 1
        if left:
            self._owned[key] = left
        else:
            del self._owned[key]  # NOTE: tenants come and go; keep only current holders

    # ------------------------------------------------------------------ reset

    def clear(self) -> None:
        """Forget every cached block and retention (restart / reset). Emits `cleared`.

        Active blocks keep their references but lose their hash, so they return as
        empty when their requests finish.
        """
        queue = self.free_queue
        for block in self.cached.values():
            block.block_hash = None
            if block.ref_cnt == 0:
                # NOTE: empty now, so it goes to the head like any empty block (a parked
                # one rejoins the queue there). A strategy that keeps cached blocks in
                # several lists would otherwise keep it behind fresh cached blocks.
                if block.prev_free is not None:
                    queue.remove(block)
                queue.appendleft(block)
        for block in self.blocks:
            block.retained_until = 0.0
            block.retained_by = None
        self.cached.clear()
        self._owned.clear()
        self._retain_deadlines.clear()
        self._num_cached_free = 0
        self._num_retained = 0
        self._copies.clear()
        if self.lower is not None:
            self.lower.clear()
        self._events.append(AllBlocksCleared())

    # ---------------------------------------------------------- observability

    def take_events(self) -> list[KVEvent]:
        """Drain queued events, oldest first."""
        events = self._events[:]
        self._events.clear()  # in place: the lower tiers append to this same list
        return events

    # ---------------------------------------------------------------- copies

    def take_copies(self) -> list[BlockCopy]:
        """Drain queued tier copies, in the order the engine must run them."""
        copies = self._copies[:]
        self._copies.clear()
        return copies

    def queue_copy(self, copy: BlockCopy) -> None:
        self._copies.append(copy)

    def finish_copies(self, copies: Sequence[BlockCopy], ok: bool) -> None:
        """The engine ran ``copies`` (or failed to): publish or drop what they demoted.

        Promotions need nothing here: their device blocks are published by the
        request's commit, or returned by its abort.
        """
        for copy in copies:
            if copy.dst_tier is Tier.DEVICE:
                continue
            store = self._store(copy.dst_tier)
            slot = store.slots[copy.dst_index]
            if ok:
                store.complete(slot, copy.block_hash)
            else:
                store.fail(slot, copy.block_hash)

    def _store(self, tier: Tier) -> TierStore:
        for store in self.lower or ():
            if store.tier is tier:
                return store
        raise ValueError(f"this pool has no {tier} tier")

    def tier_stats(self) -> list[TierStats]:
        return [store.stats() for store in self.lower or ()]

    def counts(self) -> BlockCounts:
        self.expire()
        return BlockCounts(
            total=self.num_blocks,
            active=self._num_active,
            cached_free=self._num_cached_free,
            empty=self.num_blocks - self._num_active - self._num_cached_free,
            retained=self._num_retained,
            max_retained=self.max_retained,
            retained_owners=len(self._owned),
        )

    def check_invariants(self) -> None:
        """O(n) audit of every invariant; for tests and debugging, never the hot path.

        Retention is lazy: a block counts as retained until `expire()` releases it.
        """
        in_queue = {b.block_id for b in self.free_queue}
        assert len(in_queue) == len(self.free_queue), "free queue length drifted"
        active = cached_free = retained = 0
        owned: dict[str, int] = {}
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            queued = block.block_id in in_queue
            if block.retained_until > 0.0:
                retained += 1
                assert block.retained_by is not None, f"block {block.block_id} has no owner"
                owned[block.retained_by] = owned.get(block.retained_by, 0) + 1
            else:
                assert block.retained_by is None, f"block {block.block_id} charged, not retained"
            if block.ref_cnt > 0:
                active += 1
                assert not queued, f"active block {block.block_id} is in the free queue"
            elif block.block_hash is None:
                assert queued, f"empty block {block.block_id} is not in the free queue"
            else:
                cached_free += 1
                parked = block.retained_until > 0.0
                assert queued != parked, f"cached-free block {block.block_id} queued={queued}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, "index points elsewhere"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
        assert active == self._num_active, "active counter drifted"
        assert cached_free == self._num_cached_free, "cached-free counter drifted"
        assert retained == self._num_retained, "retained counter drifted"
        assert retained <= self.max_retained, "retained share cap exceeded"
        assert owned == self._owned, f"per-owner counts drifted: {self._owned} != {owned}"
        assert sum(self._owned.values()) == self._num_retained
        seen = set(self.cached)
        for store in self.lower or ():
            store.check_invariants()
            for h in store._index:
                assert h not in seen, f"{h!r} is visible in two tiers"
                seen.add(h)
