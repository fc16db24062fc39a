"""TierStore: a bounded lower tier (host DRAM or local disk) behind the device pool.

A block evicted from the tier above is *demoted* here instead of vanishing; a prefix
hit here is *promoted* back into device blocks before prefill. The store keeps only
metadata: the bytes live in the engine's host tensors or disk files, and every
movement is a `BlockCopy` that the engine runs in the order it was queued.

Write-then-publish across tiers: a demoted block is *pending* (reserved, invisible)
until the engine reports its copy done, and only then can it be hit. A promoted
block stays visible here, pinned, until the device publishes it; only then does it
leave this tier, so a failed prefill loses nothing.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .clock import Clock, monotonic_clock
from .copies import BlockCopy
from .events import BlockRemoved, BlockStored, KVEvent
from .hashing import BlockHash
from .retention import DeadlineHeap
from .tier import TIER_ORDER, Tier


class SlotState(enum.Enum):
    EMPTY = "empty"  # free storage
    PENDING = "pending"  # reserved for a copy in flight; invisible
    VISIBLE = "visible"  # in the tier's index: hittable
    DOOMED = "doomed"  # left the index while promotions still read it; freed at unpin


@dataclass(slots=True, eq=False)
class TierSlot:
    """Metadata of one block's worth of storage in a lower tier."""

    index: int  # slot number in the tier's storage; never changes
    state: SlotState = SlotState.EMPTY
    block_hash: BlockHash | None = None  # set unless EMPTY
    pins: int = 0  # in-flight promotions reading this slot; it cannot be reused meanwhile
    retained_until: float = 0.0  # TTL deadline carried down from the tier above; 0.0 = none
    retained_by: str | None = None  # owner key charged for that retention in this tier


@dataclass(frozen=True, slots=True)
class TierStats:
    """One lower tier's occupancy and lifetime counters (exact, never sampled)."""

    tier: Tier  # which tier
    slots: int  # capacity in blocks
    used: int  # slots not empty (visible, pending or doomed)
    visible: int  # hittable blocks
    retained: int  # TTL-retained blocks right now
    max_retained: int  # cap on `retained` from the tier's retained share
    hits: int  # blocks matched here for a prefix hit (promotions started), ever
    promotions: int  # blocks that moved up from here into the device index, ever
    demotions: int  # blocks whose copy into this tier completed, ever
    evictions: int  # visible blocks pushed out of this tier (down a tier or dropped), ever
    dropped: int  # of those, gone from every tier (no tier below, or it was full)
    failed_copies: int  # demotions into this tier whose copy failed, ever


class TierStore:
    """A fixed set of slots with its own LRU, retention cap and counters.

    Invariants (``check_invariants``): a hash is visible at most once; the LRU holds
    exactly the visible, unpinned, unretained slots; retained slots are charged to
    one owner each and never exceed the cap; pending and doomed slots are invisible.
    """

    def __init__(
        self,
        tier: Tier,
        num_slots: int,
        *,
        retained_share: float = 0.5,
        owner_share: float = 1.0,
        clock: Clock = monotonic_clock,
        lower: TierStore | None = None,
    ) -> None:
        self.tier: Tier = tier  # which tier this store models
        if tier is Tier.DEVICE:
            raise ValueError("a TierStore is a lower tier; the device tier is the BlockPool")
        if num_slots <= 0:
            raise ValueError(f"{tier} tier needs a positive number of slots, got {num_slots}")
        if not 0.0 <= retained_share <= 1.0:
            raise ValueError("retained_share must be within [0, 1]")
        if not 0.0 <= owner_share <= 1.0:
            raise ValueError("owner_share must be within [0, 1]")
        if lower is not None and TIER_ORDER.index(lower.tier) <= TIER_ORDER.index(tier):
            raise ValueError(f"the tier below {tier} must be slower, got {lower.tier}")
        self.clock = clock
        self.lower = lower
        self.slots = [TierSlot(index=i) for i in range(num_slots)]
        self.max_retained = int(retained_share * num_slots)
        # NOTE: each owner's share of this tier's retained budget, as on the device, so
        # one tenant cannot move its way into every tier's whole budget.
        self.owner_quota = int(owner_share * self.max_retained + 1e-9)
        self._index: dict[BlockHash, TierSlot] = {}  # visible slots by hash
        self._lru: OrderedDict[int, TierSlot] = OrderedDict()  # evictable, oldest first
        self._empty: list[TierSlot] = list(reversed(self.slots))  # a stack: low slots first
        self._deadlines: DeadlineHeap[TierSlot] = DeadlineHeap()
        self._num_retained = 0
        self._owned: dict[str, int] = {}  # owner key -> retained slots charged to it
        # Shared with the pool above (see `bind`): one ordered log of events and one
        # of copies for the whole hierarchy, so the engine runs copies in causal order.
        self._events: list[KVEvent] = []
        self._copies: list[BlockCopy] = []
        self._visible_above: Callable[[BlockHash], bool] = _nowhere
        self.num_hits = 0
        self.num_promotions = 0
        self.num_demotions = 0
        self.num_evictions = 0
        self.num_dropped = 0
        self.num_failed_copies = 0

    def bind(
        self,
        events: list[KVEvent],
        copies: list[BlockCopy],
        visible_above: Callable[[BlockHash], bool],
    ) -> None:
        """Share the pool's event and copy logs; ``visible_above(h)``: hittable higher up."""
        self._events = events
        self._copies = copies
        self._visible_above = visible_above
        if self.lower is not None:
            self.lower.bind(events, copies, lambda h: h in self._index or visible_above(h))

    # ---------------------------------------------------------------- lookup

    def __iter__(self) -> Iterator[TierStore]:
        """This tier and every tier below it, fastest first."""
        store: TierStore | None = self
        while store is not None:
            yield store
            store = store.lower

    def find(self, block_hash: BlockHash) -> tuple[TierStore, TierSlot] | None:
        """The tier (this or below) where ``block_hash`` is visible, and its slot."""
        for store in self:
            slot = store._index.get(block_hash)
            if slot is not None:
                return store, slot
        return None

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    @property
    def num_visible(self) -> int:
        return len(self._index)

    def visible_hashes(self) -> list[BlockHash]:
        """Every hash hittable in this tier now (a snapshot for the router)."""
        return list(self._index)

    # ------------------------------------------------------------- promotion

    def pin(self, slot: TierSlot) -> None:
        """A promotion reads ``slot``: keep it from eviction until `unpin`."""
        if slot.state is not SlotState.VISIBLE:
            raise ValueError(f"{self.tier} slot {slot.index} is {slot.state.value}; pin a hit")
        self._lru.pop(slot.index, None)
        slot.pins += 1

    def unpin(self, slot: TierSlot) -> None:
        if slot.pins <= 0:
            raise ValueError(f"{self.tier} slot {slot.index} unpinned more often than pinned")
        slot.pins -= 1
        if slot.pins:
            return
        if slot.state is SlotState.DOOMED:
            self._free(slot)
        elif slot.state is SlotState.VISIBLE and slot.retained_until == 0.0:
            self._lru[slot.index] = slot  # just wanted: most recently used

    def take(self, slot: TierSlot, *, promoted: bool) -> None:
        """The hash became visible on the device: leave this tier's index.

        ``promoted``: it got there by a copy from here, rather than being recomputed.
        """
        self._unindex(slot)
        if promoted:
            self.num_promotions += 1

    def _unindex(self, slot: TierSlot) -> None:
        h = slot.block_hash
        assert h is not None and self._index.get(h) is slot
        del self._index[h]
        self._lru.pop(slot.index, None)
        self._release_retention(slot)
        self._events.append(BlockRemoved((h,), self.tier))
        if slot.pins:
            slot.state = SlotState.DOOMED
        else:
            self._free(slot)

    # -------------------------------------------------------------- demotion

    def can_accept_retained(self, owner: str | None = None) -> bool:
        """A retained block (of ``owner``) could be demoted here now: cap, quota, a slot."""
        self.expire()
        if self._num_retained >= self.max_retained or not (self._empty or self._lru):
            return False
        return owner is None or self._within_quota(owner)

    def _within_quota(self, owner: str) -> bool:
        if self.owner_quota >= self.max_retained:
            return True
        return self._owned.get(owner, 0) < self.owner_quota

    def reserve(
        self,
        block_hash: BlockHash,
        src_tier: Tier,
        src_index: int,
        *,
        retained_until: float = 0.0,
        retained_by: str | None = None,
    ) -> TierSlot | None:
        """Reserve a slot for ``block_hash`` arriving from ``src_tier`` and queue its copy.

        The slot stays invisible until `complete`. Makes room by pushing this tier's
        least recently used block one tier down (or dropping it). Returns None, and
        queues nothing, when every slot is pending, pinned or retained, or when a
        retained block would exceed this tier's cap.
        """
        self.expire()
        if retained_until > 0.0:
            assert retained_by is not None, "a retained block has an owner"
            if self._num_retained >= self.max_retained or not self._within_quota(retained_by):
                return None
        slot = self._empty.pop() if self._empty else self._evict_one()
        if slot is None:
            return None
        slot.state = SlotState.PENDING
        slot.block_hash = block_hash
        if retained_until > 0.0:
            assert retained_by is not None
            self._charge(slot, retained_until, retained_by)
        self._copies.append(BlockCopy(block_hash, src_tier, src_index, self.tier, slot.index))
        return slot

    def _evict_one(self) -> TierSlot | None:
        if not self._lru:
            return None
        _, victim = self._lru.popitem(last=False)
        h = victim.block_hash
        assert h is not None
        del self._index[h]
        self.num_evictions += 1
        self._events.append(BlockRemoved((h,), self.tier))
        # NOTE: the copy down is queued before the copy that will overwrite this slot,
        # and the engine runs copies in order, so the victim's bytes are read first.
        if self.lower is None or self.lower.reserve(h, self.tier, victim.index) is None:
            self.num_dropped += 1
        victim.state = SlotState.EMPTY
        victim.block_hash = None
        return victim

    def complete(self, slot: TierSlot, block_hash: BlockHash) -> bool:
        """The copy into ``slot`` finished: make it visible. False if it was dropped.

        A block that became visible elsewhere meanwhile (recomputed on the device, or
        an earlier copy of it already landed) is dropped here: a hash is hittable in
        one place only.
        """
        if slot.state is not SlotState.PENDING or slot.block_hash != block_hash:
            return False  # cleared (restart) since the copy was queued
        if block_hash in self._index or self._visible_above(block_hash):
            self._release_retention(slot)
            self._free(slot)
            return False
        slot.state = SlotState.VISIBLE
        self._index[block_hash] = slot
        if slot.retained_until == 0.0:
            self._lru[slot.index] = slot
        self.num_demotions += 1
        self._events.append(BlockStored((block_hash,), None, self.tier))
        return True

    def fail(self, slot: TierSlot, block_hash: BlockHash) -> None:
        """The copy into ``slot`` failed: its bytes are garbage, so it is never published."""
        if slot.state is not SlotState.PENDING or slot.block_hash != block_hash:
            return
        self.num_failed_copies += 1
        self._release_retention(slot)
        self._free(slot)

    def _free(self, slot: TierSlot) -> None:
        slot.state = SlotState.EMPTY
        slot.block_hash = None
        self._empty.append(slot)

    # -------------------------------------------------------------- retention

    def _charge(self, slot: TierSlot, until: float, owner: str) -> None:
        slot.retained_until = until
        slot.retained_by = owner
        self._deadlines.push(until, slot)
        self._num_retained += 1
        self._owned[owner] = self._owned.get(owner, 0) + 1

    def _release_retention(self, slot: TierSlot) -> None:
        if slot.retained_until == 0.0:
            return
        owner = slot.retained_by
        assert owner is not None
        slot.retained_until = 0.0
        slot.retained_by = None
        self._num_retained -= 1
        left = self._owned[owner] - 1
        if left:
            self._owned[owner] = left
        else:
            del self._owned[owner]

    def retain(self, slots: list[TierSlot], until: float, owner: str) -> bool:
        """Extend visible slots' retention to ``until`` (an entry hit refreshing its TTL).

        All or nothing against the cap; slots already retained keep their owner.
        """
        self.expire()
        fresh = [s for s in slots if s.retained_until == 0.0]
        if self._num_retained + len(fresh) > self.max_retained:
            return False
        held = self._owned.get(owner, 0)
        if fresh and self.owner_quota < self.max_retained and held + len(fresh) > self.owner_quota:
            return False
        for slot in slots:
            if slot.state is not SlotState.VISIBLE:
                raise ValueError(f"{self.tier} slot {slot.index} is not visible")
            if slot.retained_until == 0.0:
                self._lru.pop(slot.index, None)
                self._charge(slot, until, owner)
            elif until > slot.retained_until:
                slot.retained_until = until
                self._deadlines.push(until, slot)
        return True

    def expire(self, now: float | None = None) -> int:
        """Release retentions that are due; released blocks are evicted first."""
        if now is None:
            now = self.clock()
        released = 0
        for deadline, slot in self._deadlines.pop_due(now):
            if slot.retained_until != deadline:
                continue  # refreshed since, released, or the slot was reused
            self._release_retention(slot)
            released += 1
            if slot.state is SlotState.VISIBLE and slot.pins == 0:
                self._lru[slot.index] = slot
                self._lru.move_to_end(slot.index, last=False)
        return released

    def retained_by(self, owner_key: str) -> int:
        self.expire()
        return self._owned.get(owner_key, 0)

    # ------------------------------------------------------------------ reset

    def clear(self) -> None:
        """Forget everything (restart). Pending copies are voided: `complete` ignores them."""
        for store in self:
            for slot in store.slots:
                slot.state = SlotState.EMPTY
                slot.block_hash = None
                slot.pins = 0
                slot.retained_until = 0.0
                slot.retained_by = None
            store._index.clear()
            store._lru.clear()
            store._empty = list(reversed(store.slots))
            store._deadlines.clear()
            store._num_retained = 0
            store._owned.clear()

    # ---------------------------------------------------------- observability

    def stats(self) -> TierStats:
        self.expire()
        return TierStats(
            tier=self.tier,
            slots=len(self.slots),
            used=len(self.slots) - len(self._empty),
            visible=len(self._index),
            retained=self._num_retained,
            max_retained=self.max_retained,
            hits=self.num_hits,
            promotions=self.num_promotions,
            demotions=self.num_demotions,
            evictions=self.num_evictions,
            dropped=self.num_dropped,
            failed_copies=self.num_failed_copies,
        )

    def check_invariants(self) -> None:
        """O(n) audit, for tests."""
        empty = {s.index for s in self._empty}
        assert len(empty) == len(self._empty), "a slot is on the empty stack twice"
        retained = 0
        owned: dict[str, int] = {}
        for slot in self.slots:
            assert slot.pins >= 0
            if slot.state is SlotState.EMPTY:
                assert slot.index in empty and slot.block_hash is None and slot.pins == 0
                assert slot.retained_until == 0.0
            else:
                assert slot.index not in empty and slot.block_hash is not None
            visible = slot.state is SlotState.VISIBLE
            assert (slot.block_hash in self._index and self._index[slot.block_hash] is slot) == (
                visible
            ), f"{self.tier} slot {slot.index} index/state mismatch"
            evictable = visible and slot.pins == 0 and slot.retained_until == 0.0
            assert (slot.index in self._lru) == evictable, f"{self.tier} slot {slot.index} LRU"
            if slot.state is SlotState.DOOMED:
                assert slot.pins > 0, "a doomed slot is freed at its last unpin"
            if slot.retained_until > 0.0:
                assert slot.retained_by is not None
                retained += 1
                owned[slot.retained_by] = owned.get(slot.retained_by, 0) + 1
            else:
                assert slot.retained_by is None
        assert retained == self._num_retained, "retained counter drifted"
        assert retained <= self.max_retained, "retained cap exceeded"
        if self.owner_quota < self.max_retained:
            assert all(n <= self.owner_quota for n in owned.values()), "owner quota exceeded"
        assert owned == self._owned, "per-owner counts drifted"


def _nowhere(block_hash: BlockHash) -> bool:
    return False
