"""A clairvoyant eviction strategy: a reference line for reports, never a product setting.

It evicts the free block whose next use in the trace lies furthest ahead
(Belady's rule), through kvcore's own `PriorityFreeQueue`. Where it lands shows
how much of the gap to the infinite-cache bound is the pool not knowing the
future, as against routing or the pool's mechanics.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from cachepoint.kvcore import BlockHash, Clock, FreeQueue, KVBlock, PriorityFreeQueue
from cachepoint.sim.content import PreparedRequest
from cachepoint.sim.trace import Trace


class NextUseTable:
    """Every arrival time at which each block hash is part of a prompt."""

    __slots__ = ("_uses",)

    def __init__(self, uses: dict[BlockHash, list[float]]) -> None:
        self._uses = uses  # hash -> ascending arrival times (simulated seconds)

    @staticmethod
    def build(trace: Trace, prepared: Sequence[PreparedRequest], time_scale: float) -> NextUseTable:
        uses: defaultdict[BlockHash, list[float]] = defaultdict(list)
        for req, prep in zip(trace.requests, prepared, strict=True):
            at = req.arrival_s * time_scale
            for h in prep.block_hashes:
                uses[h].append(at)  # arrivals are in order, so each list is sorted
        return NextUseTable(dict(uses))

    def next_use(self, block_hash: BlockHash | None, now: float) -> float:
        """The first arrival after ``now`` that uses the block; inf if none."""
        if block_hash is None:
            return -math.inf  # empty: reuse first
        times = self._uses.get(block_hash)
        if not times:
            return math.inf
        i = bisect.bisect_right(times, now)
        return times[i] if i < len(times) else math.inf


@dataclass(frozen=True, slots=True)
class OracleEviction:
    """Belady: evict the block whose next use is furthest away (knows the whole trace)."""

    table: NextUseTable  # the trace's future
    name: str = "oracle"  # how reports name this strategy

    def make_queue(self, blocks: list[KVBlock], clock: Clock) -> FreeQueue:
        table = self.table

        def priority(block: KVBlock) -> float:
            return -table.next_use(block.block_hash, clock())

        return PriorityFreeQueue(blocks, priority)
