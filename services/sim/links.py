"""The copy links of one replica: when a batch of tier copies finishes, and who waits for it.

A replica has three links: PCIe host -> device (promotions), PCIe device -> host
(demotions; PCIe is full duplex, so the two directions do not slow each other) and
its NVMe drive (reads and writes share it). Each link moves one copy at a time, in
the order kvcore hands them out; a copy that crosses two links (disk -> device,
staged through host memory) holds both for its whole duration, at the slower rate.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from cachepoint.sim.cost import ReplicaCostModel

LINKS = ("h2d", "d2h", "nvme")  # a replica's copy links


class CopyLike(Protocol):
    """What a copy needs to be timed: kvcore's `BlockCopy` has these."""

    @property
    def src_tier(self) -> str: ...

    @property
    def dst_tier(self) -> str: ...


def links_of(src: str, dst: str) -> tuple[str, ...]:
    """The links one copy from tier ``src`` to tier ``dst`` occupies."""
    out: list[str] = []
    if dst == "device":
        out.append("h2d")
    if src == "device":
        out.append("d2h")
    if "disk" in (src, dst):
        out.append("nvme")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class BatchTiming:
    """When one batch of copies completes."""

    promoted_at: float  # the last promotion (a copy into the device) is done; now if none
    demoted_at: float  # the last demotion (a copy out of the device or host) is done; now if none
    promoted_bytes: dict[str, int]  # bytes promoted, by source tier
    demoted_bytes: dict[str, int]  # bytes demoted, by destination tier


@dataclass(slots=True)
class LinkSchedule:
    """Busy-until times and totals of one replica's copy links."""

    cost: ReplicaCostModel  # bandwidths
    block_bytes: int  # KV bytes of one pool block
    free_at: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    busy_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LINKS, 0.0))
    promoted_bytes: dict[str, int] = field(default_factory=dict)  # ever, by source tier
    demoted_bytes: dict[str, int] = field(default_factory=dict)  # ever, by destination tier
    _plans: dict[tuple[str, str], tuple[tuple[str, ...], float]] = field(
        default_factory=dict, repr=False
    )  # (src, dst) -> (links, seconds per block)

    def schedule(self, copies: Iterable[CopyLike], now: float) -> BatchTiming:
        """Queue ``copies`` in order from ``now``; a copy starts when all its links are free.

        NOTE: a promotion is a copy whose destination is the device: the prefill
        that reads it waits for it. Everything else is a demotion, which nothing on
        the request's path waits for, but it holds its links, so a promotion queued
        behind it on the NVMe drive waits longer.
        """
        promoted_at = demoted_at = now
        promoted: dict[str, int] = {}
        demoted: dict[str, int] = {}
        free = self.free_at
        # NOTE: consecutive copies of one kind hold the same links one after the
        # other, so a run of n of them is timed as one n-block copy (kvcore queues a
        # batch's demotions together, then its promotions): same result, fewer steps.
        for (src, dst), run in itertools.groupby(copies, _kind):
            n = sum(1 for _ in run)
            links, took_one = self._plan(src, dst)
            took = n * took_one
            start = max(now, *(free[k] for k in links))
            end = start + took
            nbytes = n * self.block_bytes
            for k in links:
                free[k] = end
                self.busy_s[k] += took
            if dst == "device":
                promoted_at = max(promoted_at, end)
                promoted[src] = promoted.get(src, 0) + nbytes
                self.promoted_bytes[src] = self.promoted_bytes.get(src, 0) + nbytes
            else:
                demoted_at = max(demoted_at, end)
                demoted[dst] = demoted.get(dst, 0) + nbytes
                self.demoted_bytes[dst] = self.demoted_bytes.get(dst, 0) + nbytes
        return BatchTiming(promoted_at, demoted_at, promoted, demoted)

    def _plan(self, src: str, dst: str) -> tuple[tuple[str, ...], float]:
        """The links and seconds of one block copy of this kind (computed once)."""
        key = (src, dst)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = (
                links_of(src, dst),
                self.cost.copy_s(src, dst, self.block_bytes),
            )
        return plan


def _kind(copy: CopyLike) -> tuple[str, str]:
    return str(copy.src_tier), str(copy.dst_tier)
