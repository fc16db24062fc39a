"""The retention connector's bookkeeping: which vLLM blocks it holds, for which entry,
until when. Pure Python over anything shaped like vLLM's ``BlockPool`` (``blocks``,
``touch``, ``free_blocks``), so the refcount rules are tested without vLLM.

A pin is one reference (``BlockPool.touch``) on each block under one managed entry,
taken when the request that wrote or read the entry finishes; vLLM never evicts a block
whose ``ref_cnt`` is above zero. It is dropped (``free_blocks``) exactly once: when it
expires, when it is replaced by a pin of the same entry on other blocks, or when
everything is released (vLLM's cache reset, shutdown).

What to pin is decided by the replica (kvcore's `PinLedger`, in the shim's process) and
travels in the request's ``kv_transfer_params`` under `PARAMS_KEY`:
``{"pins": [{"key": str, "blocks": int, "ttl": float}, ...]}``, ``blocks`` counting
from the prompt's first block. Nothing here decides a share or a quota.

NOTE: a pin only ever adds a reference to a block vLLM has cached; it never changes a
block's content or hash. Losing this table (a bug, a crash) can therefore only lose
pins (the entry is written again later), never serve stale KV.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

PARAMS_KEY = "cachepoint"  # our part of a request's kv_transfer_params


class BlockLike(Protocol):
    block_id: int
    ref_cnt: int
    is_null: bool

    @property
    def block_hash(self) -> Any: ...


class PoolLike(Protocol):
    """What the table needs of vLLM's ``BlockPool``."""

    blocks: Sequence[Any]

    def touch(self, blocks: Sequence[Any]) -> None: ...

    def free_blocks(self, ordered_blocks: Sequence[Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class PinSpec:
    """One entry to pin, as the replica asked."""

    key: str  # the managed entry's key (hex): a read of the entry refreshes this pin
    blocks: int  # full blocks under the entry, from the prompt's first
    ttl: float  # seconds from the request's end

    @staticmethod
    def parse(params: dict[str, Any] | None) -> list[PinSpec]:
        """The pins a request's ``kv_transfer_params`` ask for; [] when none. Raises
        ValueError on a malformed list (the replica wrote it: a bug, said loudly)."""
        ours = (params or {}).get(PARAMS_KEY)
        if not ours:
            return []
        out = []
        for p in ours.get("pins", ()):
            spec = PinSpec(str(p["key"]), int(p["blocks"]), float(p["ttl"]))
            if spec.blocks <= 0 or spec.ttl <= 0:
                raise ValueError(f"pin {spec}: blocks and ttl must be positive")
            out.append(spec)
        return out


@dataclass(slots=True)
class Pin:
    """References held on one entry's blocks."""

    key: str  # the entry's key
    blocks: tuple[Any, ...]  # vLLM KVCacheBlocks, in chain order; one reference each
    until: float  # clock seconds


@dataclass(frozen=True, slots=True)
class FinishReport:
    """What one finished request's pins did; returned to the replica in the request's
    output ``kv_transfer_params`` (under `PARAMS_KEY`)."""

    pinned: int  # entries pinned anew
    refreshed: int  # entries already pinned whose deadline moved
    skipped: int  # entries whose blocks the request did not compute or hold cached
    pinned_blocks: int  # distinct blocks the table holds now
    pins: int  # entries it holds now

    def as_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "pinned": self.pinned,
                "refreshed": self.refreshed,
                "skipped": self.skipped,
                "pinned_blocks": self.pinned_blocks,
                "pins": self.pins,
            }
        }


class PinTable:
    """Pins by entry key, with their deadlines."""

    def __init__(self, pool: PoolLike, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self.pins: dict[str, Pin] = {}
        self.expired = 0  # pins released at their deadline, ever
        self._deadlines: list[tuple[float, int, str]] = []  # (until, seq, key); lazy
        self._seq = itertools.count()
        self._refs: dict[int, int] = {}  # block id -> pins holding it (> 0)

    # ------------------------------------------------------------------ pinning

    def finished(
        self,
        specs: Sequence[PinSpec],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        block_size: int,
    ) -> FinishReport:
        """A request finished holding ``block_ids`` (its computed prefix): pin each
        entry whose blocks it computed (or reused) and that vLLM holds cached."""
        now = self.clock()
        self.expire(now)
        pinned = refreshed = skipped = 0
        for spec in specs:
            n = spec.blocks
            if n > len(block_ids) or n * block_size > num_computed_tokens:
                skipped += 1  # aborted or preempted before its prefix was computed
                continue
            blocks = tuple(self.pool.blocks[i] for i in block_ids[:n])
            if any(b.is_null or b.block_hash is None for b in blocks):
                skipped += 1  # not cached (prefix caching refused it): nothing to keep
                continue
            if self._pin(spec.key, blocks, now + spec.ttl):
                pinned += 1
            else:
                refreshed += 1
        return FinishReport(pinned, refreshed, skipped, len(self._refs), len(self.pins))

    def _pin(self, key: str, blocks: tuple[Any, ...], until: float) -> bool:
        """Pin ``blocks`` for ``key`` until ``until``; True when newly pinned."""
        old = self.pins.get(key)
        if old is not None and [b.block_id for b in old.blocks] == [b.block_id for b in blocks]:
            if until > old.until:
                old.until = until
                heapq.heappush(self._deadlines, (until, next(self._seq), key))
            return False
        # NOTE: new references first, then the old ones dropped: a block in both never
        # touches zero in between (it would rejoin vLLM's free queue for nothing).
        self.pool.touch(blocks)
        for b in blocks:
            self._refs[b.block_id] = self._refs.get(b.block_id, 0) + 1
        pin = Pin(key, blocks, until if old is None else max(until, old.until))
        self.pins[key] = pin
        heapq.heappush(self._deadlines, (pin.until, next(self._seq), key))
        if old is not None:
            self._unref(old)
        return old is None

    # ---------------------------------------------------------------- releasing

    def expire(self, now: float | None = None) -> int:
        """Release the pins that are due; returns how many. O(1) when none is."""
        if now is None:
            now = self.clock()
        released = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            until, _, key = heapq.heappop(heap)
            pin = self.pins.get(key)
            if pin is None or pin.until != until:
                continue  # stale: refreshed, replaced or released since
            del self.pins[key]
            self._unref(pin)
            released += 1
        self.expired += released
        return released

    def release_all(self) -> int:
        """Drop every pin (vLLM's cache reset, shutdown); returns how many."""
        pins = list(self.pins.values())
        self.pins.clear()
        self._deadlines.clear()
        for pin in pins:
            self._unref(pin)
        return len(pins)

    def _unref(self, pin: Pin) -> None:
        for b in pin.blocks:
            left = self._refs[b.block_id] - 1
            if left:
                self._refs[b.block_id] = left
            else:
                del self._refs[b.block_id]
        # NOTE: vLLM's free order is eviction order (first evicted first): the tail of
        # the chain goes first, as vLLM frees a finished request's blocks.
        self.pool.free_blocks(list(reversed(pin.blocks)))

    # ------------------------------------------------------------------ reading

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self._refs)

    def refs(self, block_id: int) -> int:
        """References the table holds on one block."""
        return self._refs.get(block_id, 0)
