"""Retention of another engine's blocks: kvcore's rules over block hashes.

`BlockPool.retain` keeps kvcore's own blocks for their TTL. An engine with its own pool
(vLLM) cannot be told how to evict, but a connector inside it can hold a reference on
blocks (docs/vllm.md, "Retention"). `PinLedger` is what decides which of those pins
may be taken: the same rules as the pool's retention, over the kvcore chain hashes the
mirror names the engine's blocks by, with no blocks of its own.

- a retain is all or nothing: it is refused whole when the blocks it would newly
  retain push the retained count past the cap (``retained_share`` of the engine's
  pool) or their owner past its quota (its share of the cap);
- a block is charged to the owner whose retain first retained it, until it expires;
- a retain never shortens a retention, and only newly retained blocks count.

The connector carries out what was granted; it never decides (one policy, here).
``tests/kvcore/test_pin_ledger.py`` drives this and `BlockPool` with the same
operations and checks they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .clock import Clock, monotonic_clock
from .hashing import BlockHash
from .retention import UNATTRIBUTED, DeadlineHeap, RetainResult, RetentionOwner, owner_quota


@dataclass(slots=True)
class _Held:
    """One retained block hash."""

    until: float  # clock seconds; the latest deadline any retain asked for
    owner: str  # the owner key it is charged to


@dataclass(frozen=True, slots=True)
class PinStats:
    """What ``/v1/stats`` reports of the ledger."""

    retained: int  # block hashes retained now
    max_retained: int  # the cap
    owners: int  # owners holding at least one
    refusals: int  # retains refused (cap or quota), ever
    quota_refusals: int  # of those, by an owner's quota
    expired: int  # block retentions that ran out, ever


class PinLedger:
    """Which block hashes are retained, until when, charged to whom."""

    __slots__ = (
        "_deadlines",
        "_held",
        "_owned",
        "clock",
        "max_retained",
        "num_expired",
        "num_quota_refusals",
        "num_retain_refusals",
        "owner_share",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        retained_share: float = 0.5,
        owner_share: float = 1.0,
        clock: Clock = monotonic_clock,
    ) -> None:
        if num_blocks < 0:
            raise ValueError("num_blocks must not be negative")
        if not 0.0 <= retained_share <= 1.0:
            raise ValueError("retained_share must be within [0, 1]")
        if not 0.0 <= owner_share <= 1.0:
            raise ValueError("owner_share must be within [0, 1]")
        self.clock = clock
        self.max_retained = int(retained_share * num_blocks)  # the pool's formula
        self.owner_share = owner_share  # default share of the cap one owner may hold
        self.num_retain_refusals = 0  # retains refused, ever
        self.num_quota_refusals = 0  # of those, by an owner's quota
        self.num_expired = 0  # block retentions that ran out, ever
        self._held: dict[BlockHash, _Held] = {}
        self._owned: dict[str, int] = {}  # owner key -> blocks charged to it (> 0)
        self._deadlines: DeadlineHeap[BlockHash] = DeadlineHeap()

    def __len__(self) -> int:
        self.expire()
        return len(self._held)

    def __contains__(self, block_hash: object) -> bool:
        self.expire()
        return block_hash in self._held

    def retained_until(self, block_hash: BlockHash) -> float:
        """Its deadline, or 0.0 when it is not retained."""
        self.expire()
        held = self._held.get(block_hash)
        return 0.0 if held is None else held.until

    def owner_quota(self, owner: RetentionOwner) -> int:
        """Blocks ``owner`` may hold: its share (or the default) of the cap, floored."""
        return owner_quota(owner, self.owner_share, self.max_retained)

    def retained_owners(self) -> dict[str, int]:
        self.expire()
        return dict(self._owned)

    def retain(
        self, hashes: Sequence[BlockHash], ttl: float, owner: RetentionOwner | None = None
    ) -> RetainResult:
        """Retain ``hashes`` until ``now + ttl``, all or nothing (`BlockPool.retain`'s
        rules, without a lower tier to demote into)."""
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        now = self.clock()
        self.expire(now)
        deadline = now + ttl
        fresh = {h for h in hashes if h not in self._held}
        owner = owner or UNATTRIBUTED
        held = self._owned.get(owner.key, 0)
        quota = self.owner_quota(owner)
        # NOTE: a quota equal to the cap is no per-owner limit; the cap then gives the
        # truer reason (the pool's rule, kept word for word).
        if fresh and quota < self.max_retained and held + len(fresh) > quota:
            self.num_retain_refusals += 1
            self.num_quota_refusals += 1
            return RetainResult.refused(
                f"tenant retention quota: {held} of {quota} blocks retained, "
                f"{len(fresh)} more requested",
                deadline,
            )
        total = len(self._held)
        if total + len(fresh) > self.max_retained:
            self.num_retain_refusals += 1
            return RetainResult.refused(
                f"retained share cap: {total} of {self.max_retained} blocks retained, "
                f"{len(fresh)} more requested",
                deadline,
            )
        for h in hashes:
            entry = self._held.get(h)
            if entry is None:
                self._held[h] = _Held(deadline, owner.key)
            elif deadline > entry.until:
                entry.until = deadline
            else:
                continue
            self._deadlines.push(deadline, h)
        if fresh:
            self._owned[owner.key] = held + len(fresh)
        return RetainResult(ok=True, newly_retained=len(fresh), retained_until=deadline)

    def expire(self, now: float | None = None) -> int:
        """Release retentions that are due; returns how many block hashes."""
        if now is None:
            now = self.clock()
        released = 0
        for deadline, h in self._deadlines.pop_due(now):
            entry = self._held.get(h)
            if entry is None or entry.until != deadline:
                continue  # stale: extended since, or cleared
            del self._held[h]
            left = self._owned[entry.owner] - 1
            if left:
                self._owned[entry.owner] = left
            else:
                del self._owned[entry.owner]
            released += 1
        self.num_expired += released
        return released

    def clear(self) -> None:
        """The engine's cache is gone (restart, reset): nothing is retained."""
        self._held.clear()
        self._owned.clear()
        self._deadlines.clear()

    def stats(self) -> PinStats:
        self.expire()
        return PinStats(
            retained=len(self._held),
            max_retained=self.max_retained,
            owners=len(self._owned),
            refusals=self.num_retain_refusals,
            quota_refusals=self.num_quota_refusals,
            expired=self.num_expired,
        )
