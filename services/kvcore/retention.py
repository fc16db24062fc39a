"""TTL retention primitives: the deadline heap and the result of a retain request."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

TTL_5M = 300.0
TTL_1H = 3600.0
TTL_24H = 86400.0

TTL_SECONDS: dict[str, float] = {"5m": TTL_5M, "1h": TTL_1H, "24h": TTL_24H}
"""The TTLs a `cache_control` marker may name ("24h": OpenAI's extended retention)."""

T = TypeVar("T")


class DeadlineHeap(Generic[T]):
    """Items keyed by deadline, popped once due.

    NOTE: refreshing a deadline pushes a second entry rather than re-heapifying; the
    owner recognises stale entries (the item's current deadline differs) and skips
    them. That keeps refresh O(log n) on the hit path.
    """

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []  # (deadline, tie-break seq, item)
        self._seq = itertools.count()  # FIFO among equal deadlines: chain order is kept

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, item: T) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), item))

    def pop_due(self, now: float) -> Iterator[tuple[float, T]]:
        """Yield (deadline, item) for every entry with deadline <= now, earliest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, item = heapq.heappop(heap)
            yield deadline, item

    def clear(self) -> None:
        self._heap.clear()


@dataclass(frozen=True, slots=True)
class RetentionOwner:
    """The tenant a retention is charged to, and the share of the retained budget it may hold.

    A block is charged to one owner at a time (the one whose retain made it retained),
    so per-owner counts always sum to the pool's retained count.
    """

    key: str  # tenant key, e.g. "org:<id>"; retained blocks are counted per key
    share: float | None = None  # of the pool's retained budget; None = the pool's owner_share

    def __post_init__(self) -> None:
        if self.share is not None and not 0.0 <= self.share <= 1.0:
            raise ValueError("an owner's retained share must be within [0, 1]")


def owner_quota(owner: RetentionOwner, default_share: float, max_retained: int) -> int:
    """Retained blocks ``owner`` may hold: its share (or ``default_share``) of the cap,
    floored. The one rule of `BlockPool` and `PinLedger`."""
    share = default_share if owner.share is None else owner.share
    # NOTE: the epsilon keeps e.g. 0.57 * 100 at 57, not 56.99999 -> 56.
    return int(share * max_retained + 1e-9)


UNATTRIBUTED = RetentionOwner("-")
"""Owner of retains that name none (old callers, tools): one tenant, the default share."""


@dataclass(frozen=True, slots=True)
class RetainResult:
    """Outcome of asking the pool to retain blocks."""

    ok: bool  # False when the request was refused and nothing changed
    newly_retained: int  # blocks that were not retained before this call
    retained_until: float  # the deadline asked for (clock seconds)
    reason: str | None = None  # why it was refused, for the client-facing report

    @staticmethod
    def refused(reason: str, retained_until: float) -> RetainResult:
        return RetainResult(
            ok=False, newly_retained=0, retained_until=retained_until, reason=reason
        )
