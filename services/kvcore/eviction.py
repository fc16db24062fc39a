"""Eviction strategies: which cached-free block the pool gives up first.

A strategy is a tiny factory for the pool's free queue (SGLang-style): the pool
moves blocks in and out of the queue and never looks inside it, so a strategy
only decides the order. Every operation stays O(1); the LRU default is the plain
`FreeBlockQueue`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from .block import KVBlock
from .clock import Clock
from .eviction_density import HitDensityEviction
from .free_queue import FreeBlockQueue


class FreeQueue(Protocol):
    """What `BlockPool` needs of its free queue. The head is evicted (or reused) first.

    Membership is intrusive: a block is in the queue iff ``block.prev_free`` is set.
    """

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KVBlock]: ...

    def __contains__(self, block: KVBlock) -> bool: ...

    def append(self, block: KVBlock) -> None:
        """A block became free and still holds a hittable hash: queue it by its value."""
        ...

    def appendleft(self, block: KVBlock) -> None:
        """An empty block, or one whose retention just expired: give it up first."""
        ...

    def remove(self, block: KVBlock) -> None:
        """A request hit the block, or retention parked it."""
        ...

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the head, for allocation."""
        ...


class EvictionPolicy(Protocol):
    """Builds the free queue of one pool."""

    @property
    def name(self) -> str: ...

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> FreeQueue: ...


@dataclass(frozen=True, slots=True)
class LRUEviction:
    """Least recently freed goes first: vLLM's order, and kvcore's default."""

    name: str = "lru"  # how reports and settings name this strategy

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> FreeQueue:
        return FreeBlockQueue(blocks)


@dataclass(frozen=True, slots=True)
class SegmentedLRUEviction:
    """Segmented LRU: blocks hit since they were filled outlive blocks never hit.

    NOTE: in prefix-cache traces most blocks are never read again (three in four
    in Mooncake's conversation trace), and a block that has been hit once is
    nearly twice as likely to be hit again as a fresh one (42 % against 24 %).
    Plain LRU lets that stream of one-shot blocks push out hit blocks that are
    merely a few minutes idle; a protected segment capped at a share of the pool
    keeps those.
    """

    protected_share: float = 0.3  # cap on the protected segment, as a share of the pool
    name: str = "slru"  # how reports and settings name this strategy

    def __post_init__(self) -> None:
        if not 0.0 <= self.protected_share <= 1.0:
            raise ValueError("protected_share must be within [0, 1]")

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> FreeQueue:
        return SegmentedFreeQueue(blocks, int(self.protected_share * len(blocks)))


class SegmentedFreeQueue:
    """Two intrusive LRU lists: *probation* (never hit, and empty blocks) and *protected*.

    ``append`` sends a block with ``hits > 0`` to the protected tail; when that
    segment outgrows its cap, its head is demoted to the probation tail, so it gets
    one more full pass before eviction. Allocation drains probation (empty blocks
    first, at its head) before it touches protected.
    """

    __slots__ = ("_in_protected", "max_protected", "probation", "protected")

    def __init__(self, blocks: Iterable[KVBlock], max_protected: int) -> None:
        blocks = list(blocks)
        self.max_protected = max_protected  # cap on the protected segment, in blocks
        self.probation = FreeBlockQueue(blocks)  # evicted first
        self.protected = FreeBlockQueue()  # blocks that were hit while cached
        # NOTE: block ids are dense (0..n-1), so a bytearray is the cheapest
        # "which segment is it in" map; the intrusive links cannot tell.
        self._in_protected = bytearray(max((b.block_id for b in blocks), default=-1) + 1)

    def __len__(self) -> int:
        return self.probation.num_free + self.protected.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.probation
        yield from self.protected

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def append(self, block: KVBlock) -> None:
        if block.hits == 0:
            self.probation.append(block)
            return
        self.protected.append(block)
        self._in_protected[block.block_id] = 1
        if self.protected.num_free > self.max_protected:
            demoted = self.protected.popleft()
            self._in_protected[demoted.block_id] = 0
            self.probation.append(demoted)

    def appendleft(self, block: KVBlock) -> None:
        self.probation.appendleft(block)

    def remove(self, block: KVBlock) -> None:
        if self._in_protected[block.block_id]:
            self._in_protected[block.block_id] = 0
            self.protected.remove(block)
        else:
            self.probation.remove(block)

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > len(self):
            raise IndexError(f"asked for {n} free blocks, have {len(self)}")
        out = self.probation.popleft_n(min(n, self.probation.num_free))
        rest = n - len(out)
        if rest:
            taken = self.protected.popleft_n(rest)
            for block in taken:
                self._in_protected[block.block_id] = 0
            out.extend(taken)
        return out


@dataclass(frozen=True, slots=True)
class ReuseCreditEviction:
    """LRU on a shifted clock: each hit a block took buys it extra time before eviction.

    A block freed at time ``t`` after ``k`` hits is queued at ``t + credit × log2(1 +
    k)``, and the lowest goes first; ``credit`` is ``credit_share`` of the pool's
    recent eviction age (how long a freed block has lately lasted before eviction).
    With ``credit_share = 0`` this is LRU.

    NOTE: in prefix-cache traces most blocks are never read again (three in four in
    Mooncake's conversation trace), and a block hit once is nearly twice as likely
    to be hit again as a fresh one (42 % against 24 %), so hit blocks deserve
    longer. The credit is a share of the eviction age rather than fixed seconds
    because the age moves with load: a fixed 150 s credit helped at the trace's
    own rate and hurt at 6x it, where blocks last only a minute or two
    (docs/sim.md).
    """

    credit_share: float = 0.4  # credit per doubling of hits, as a share of the eviction age
    name: str = "reuse_credit"  # how reports and settings name this strategy

    def __post_init__(self) -> None:
        if self.credit_share < 0:
            raise ValueError("credit_share must be non-negative")

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> FreeQueue:
        return ReuseCreditQueue(blocks, clock, self.credit_share)


BlockPriority = Callable[[KVBlock], float]
"""A freed block's eviction priority; the lowest is evicted first."""


class PriorityFreeQueue:
    """Free blocks by priority: a head list (empty and expired blocks), then a min-heap.

    ``priority`` is read once, when a cached block is freed. O(1) for the head
    list, O(log n) for the heap; removal is lazy (a block's live heap entry is the
    one whose sequence number it records).

    NOTE: the pool tests membership with ``block.prev_free is not None`` on its hot
    path, so a block in the heap points both links at a sentinel.
    """

    __slots__ = ("_heap", "_in_heap", "_live", "_priority", "_sentinel", "_seq", "head")

    def __init__(self, blocks: Iterable[KVBlock], priority: BlockPriority) -> None:
        blocks = list(blocks)
        size = max((b.block_id for b in blocks), default=-1) + 1
        self.head = FreeBlockQueue(blocks)  # empty and expired blocks: taken before the heap
        self._priority = priority  # a freed block's priority
        self._heap: list[tuple[float, int, KVBlock]] = []  # (priority, seq, block), lazy
        self._seq = itertools.count()  # FIFO among equal priorities: chain tails go first
        self._live = [-1] * size  # block id -> seq of its live heap entry, -1 if none
        self._in_heap = 0  # live heap entries
        self._sentinel = KVBlock(block_id=-1)  # what heap members' links point at

    def __len__(self) -> int:
        return self.head.num_free + self._in_heap

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.head
        live = self._live
        for _, seq, block in self._heap:
            if live[block.block_id] == seq:
                yield block

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        seq = next(self._seq)
        heapq.heappush(self._heap, (self._priority(block), seq, block))
        if block.block_id >= len(self._live):
            self._live.extend([-1] * (block.block_id + 1 - len(self._live)))
        self._live[block.block_id] = seq
        self._in_heap += 1
        block.prev_free = block.next_free = self._sentinel
        if len(self._heap) > 2 * self._in_heap + 1024:
            self._compact()

    def appendleft(self, block: KVBlock) -> None:
        self.head.appendleft(block)

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is self._sentinel:
            self._live[block.block_id] = -1
            self._in_heap -= 1
            block.prev_free = block.next_free = None
        else:
            self.head.remove(block)

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > len(self):
            raise IndexError(f"asked for {n} free blocks, have {len(self)}")
        out = self.head.popleft_n(min(n, self.head.num_free))
        heap, live = self._heap, self._live
        while len(out) < n:
            _, seq, block = heapq.heappop(heap)
            if live[block.block_id] != seq:
                continue  # removed (hit or parked) since it was pushed
            live[block.block_id] = -1
            self._in_heap -= 1
            block.prev_free = block.next_free = None
            out.append(block)
        return out

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live[e[2].block_id] == e[1]]
        heapq.heapify(self._heap)


class ReuseCreditQueue(PriorityFreeQueue):
    """`PriorityFreeQueue` keyed by `ReuseCreditEviction`'s shifted clock.

    It measures the eviction age itself: an exponentially weighted mean of how long
    each block it evicts sat in the queue.
    """

    __slots__ = ("_clock", "_freed_at", "credit_share", "eviction_age")

    AGE_WEIGHT = 1 / 64  # weight of each evicted block in the eviction-age mean

    def __init__(self, blocks: Iterable[KVBlock], clock: Clock, credit_share: float) -> None:
        blocks = list(blocks)
        self._clock = clock  # the pool's clock
        self._freed_at = [0.0] * (max((b.block_id for b in blocks), default=-1) + 1)
        self.credit_share = credit_share  # credit per doubling of hits, share of eviction_age
        self.eviction_age = 0.0  # mean seconds an evicted block sat in the queue; 0 until one is
        super().__init__(blocks, self._priority_of)

    def _priority_of(self, block: KVBlock) -> float:
        now = self._clock()
        if block.block_id >= len(self._freed_at):
            self._freed_at.extend([0.0] * (block.block_id + 1 - len(self._freed_at)))
        self._freed_at[block.block_id] = now
        if not block.hits:
            return now
        return now + self.credit_share * self.eviction_age * math.log2(1 + block.hits)

    def popleft_n(self, n: int) -> list[KVBlock]:
        from_head = min(n, self.head.num_free)
        out = super().popleft_n(n)
        if len(out) > from_head:
            now = self._clock()
            age = self.eviction_age
            for block in out[from_head:]:
                sat = now - self._freed_at[block.block_id]
                age = sat if age == 0.0 else age + self.AGE_WEIGHT * (sat - age)
            self.eviction_age = age
        return out


EvictionClass = (
    type[LRUEviction]
    | type[SegmentedLRUEviction]
    | type[ReuseCreditEviction]
    | type[HitDensityEviction]
)

EVICTION_POLICIES: dict[str, EvictionClass] = {
    "lru": LRUEviction,
    "slru": SegmentedLRUEviction,
    "reuse_credit": ReuseCreditEviction,
    "hit_density": HitDensityEviction,
}
"""Strategies by the name settings and reports use."""

DEFAULT_EVICTION = "reuse_credit"
"""What a replica's pool runs unless told otherwise: the best measured by the trace
simulator (docs/sim.md). `BlockPool` itself defaults to plain LRU."""
