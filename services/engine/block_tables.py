"""Per-sequence block tables that persist across steps and grow incrementally.

A decoding sequence's table changes by at most one block a step, yet rebuilding it
from the scheduler's list every step costs host time linear in the context (list to
tensor, per-block validation, finding runs). :class:`BlockTables` keeps each
sequence's ids, validated once, and its *runs* (maximal stretches of consecutive pool
ids), and only looks at the blocks appended since the last step.

Runs are what lets attention read the pool in place: a run of ``n`` consecutive
blocks is one ``[kv_heads, n * block_size, head_dim]`` view of the pool, no copy.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Run:
    """Consecutive pool blocks holding consecutive positions of one sequence."""

    first: int  # index in the sequence's table (position block) of the run's first block
    block: int  # pool id of that block; the run is blocks block..block+count-1
    count: int  # blocks in the run


@dataclass(slots=True)
class SeqTable:
    """One sequence's block table as far as the engine has seen it."""

    blocks: list[int] = field(default_factory=list)  # pool ids, validated, in position order
    runs: list[Run] = field(default_factory=list)  # `blocks` as runs, in position order
    firsts: list[int] = field(default_factory=list)  # each run's `first`, for bisection
    # `blocks` as int32 on the host, grown by doubling: rows of a kernel's block table
    ids: torch.Tensor = field(default_factory=lambda: torch.zeros(16, dtype=torch.int32))

    def extend(self, ids: Sequence[int], num_blocks: int, what: str) -> None:
        """Append ``ids`` (validated here, once) and extend the runs."""
        if not ids:
            return
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: block id {bad} outside 0..{num_blocks - 1}")
        runs = self.runs
        for b in ids:
            last = runs[-1] if runs else None
            if last is not None and b == last.block + last.count:
                last.count += 1
            else:
                runs.append(Run(len(self.blocks), b, 1))
                self.firsts.append(len(self.blocks))
            self.blocks.append(b)
        n, old = len(self.blocks), len(self.blocks) - len(ids)
        if n > self.ids.shape[0]:
            grown = torch.zeros(max(n, 2 * self.ids.shape[0]), dtype=torch.int32)
            grown[:old] = self.ids[:old]
            self.ids = grown
        self.ids[old:n] = torch.tensor(ids, dtype=torch.int32)

    def run_count(self, start: int, end: int) -> int:
        """How many runs cover table indices ``start..end-1`` (O(log runs))."""
        if start >= end:
            return 0
        return bisect_right(self.firsts, end - 1) - bisect_right(self.firsts, start) + 1

    def span(self, start: int, end: int) -> list[Run]:
        """The runs covering table indices ``start..end-1``, cut to that range.

        NOTE: bisects to the first run, so the cost is the runs returned, not the runs
        before ``start``.
        """
        out: list[Run] = []
        if start >= end:
            return out
        for i in range(max(0, bisect_right(self.firsts, start) - 1), len(self.runs)):
            r = self.runs[i]
            if r.first >= end:
                break
            lo, hi = max(start, r.first), min(end, r.first + r.count)
            if lo < hi:
                out.append(Run(lo, r.block + lo - r.first, hi - lo))
        return out


def shared_blocks(a: SeqTable, b: SeqTable, limit: int) -> int:
    """How many leading table entries (at most ``limit``) ``a`` and ``b`` share.

    O(runs), not O(blocks): two runs that start at the same index and pool block hold
    the same blocks for as long as both last.
    """
    n = 0
    for ra, rb in zip(a.runs, b.runs, strict=False):
        if n >= limit or ra.first != rb.first or ra.block != rb.block:
            break
        n = ra.first + min(ra.count, rb.count)
        if ra.count != rb.count:
            break
    return min(n, limit)


class BlockTables:
    """The engine's persistent tables, keyed by the scheduler's sequence ids.

    NOTE: a sequence id names one allocation. When the scheduler gives a sequence new
    blocks in place of old ones (a preemption, a recompute), it calls :meth:`forget`
    first. As a safety net a table whose known first or last block no longer matches
    the request is rebuilt, but a change in the middle would go unseen: forgetting is
    the contract.
    """

    __slots__ = ("_num_blocks", "_tables")

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks  # valid ids are 0..num_blocks-1
        self._tables: dict[int, SeqTable] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, seq_id: int | None, table: Sequence[int], need: int, what: str) -> SeqTable:
        """The table of ``seq_id`` covering at least its first ``need`` blocks.

        ``seq_id`` None builds a throwaway table (callers that keep no identity).
        Raises ``ValueError`` when ``table`` is shorter than ``need`` or names a block
        outside the pool.
        """
        if len(table) < need:
            raise ValueError(f"{what}: block table has {len(table)} blocks, {need} needed")
        st = None if seq_id is None else self._tables.get(seq_id)
        if st is not None:
            known = len(st.blocks)
            if known > len(table) or (
                known and (table[0] != st.blocks[0] or table[known - 1] != st.blocks[-1])
            ):
                st = None  # reallocated without forget(): start over
        if st is None:
            st = SeqTable()
            if seq_id is not None:
                self._tables[seq_id] = st
        known = len(st.blocks)
        if known < need:
            st.extend(table[known:need], self._num_blocks, what)
        return st

    def forget(self, seq_id: int) -> None:
        """Drop a finished or reallocated sequence's table (unknown ids are fine)."""
        self._tables.pop(seq_id, None)
