"""One request's blocks as a transaction: hit + allocate, then commit or abort."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from .block import KVBlock
from .hashing import BlockHash
from .tier import Tier

if TYPE_CHECKING:
    from .pool import BlockPool
    from .tier_store import TierSlot, TierStore


class AllocationState(enum.Enum):
    PENDING = "pending"  # blocks held, nothing published: the forward pass is running
    COMMITTED = "committed"  # the forward pass succeeded; its full blocks are published
    ABORTED = "aborted"  # failed or cancelled; every block returned, nothing published
    FREED = "freed"  # finished after commit; every block returned


class AllocationError(RuntimeError):
    """An Allocation was driven out of order (e.g. commit after abort)."""


class Allocation:
    """The block table of one sequence and the state of its cache transaction.

    Write-then-publish: the blocks this request fills enter the hash index only in
    `commit()`, after the forward pass that filled them succeeded. Until then no
    other request can hit them and no `stored` event exists, so a failed forward
    leaves nothing visible behind (contract §3).
    """

    __slots__ = (
        "_ids",
        "_num_published",
        "_pins",
        "_pool",
        "block_hashes",
        "blocks",
        "num_hit_blocks",
        "num_tokens",
        "promoted_by_tier",
        "state",
    )

    def __init__(
        self,
        pool: BlockPool,
        blocks: list[KVBlock],
        num_hit_blocks: int,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        *,
        num_published: int | None = None,
        pins: Sequence[tuple[TierStore, TierSlot]] = (),
        promoted_by_tier: dict[Tier, int] | None = None,
    ) -> None:
        self._pool = pool
        self.blocks = blocks  # the block table: hit blocks first, then new ones
        self.num_hit_blocks = num_hit_blocks  # leading blocks hit, on the device or below
        self.block_hashes = list(block_hashes)  # chain hashes of the full blocks known so far
        self.num_tokens = num_tokens  # token slots this table covers
        self.state = AllocationState.PENDING
        # leading blocks already in the device index: the device hits; promoted blocks
        # after them are published by `commit`, once their copies and forward succeeded
        self._num_published = num_hit_blocks if num_published is None else num_published
        self._pins = list(pins)  # lower-tier slots read by promotion copies, until settled
        self.promoted_by_tier = promoted_by_tier or {}  # promoted hit blocks per source tier
        self._ids = [b.block_id for b in blocks]  # `blocks`' ids, kept in step with it

    # ------------------------------------------------------------------ views

    @property
    def block_ids(self) -> list[int]:
        """The block table's ids: a live list, not a copy; do not modify it.

        NOTE: live so that handing the table to the engine every decode step costs
        nothing: a copy would be linear in the context, every step, per sequence.
        """
        return self._ids

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV is already in the pool; prefill starts here."""
        return self.num_hit_blocks * self._pool.block_size

    @property
    def num_promoted_blocks(self) -> int:
        """Hit blocks brought up from a lower tier (they count in `num_hit_blocks`)."""
        return sum(self.promoted_by_tier.values())

    @property
    def new_blocks(self) -> list[KVBlock]:
        return self.blocks[self.num_hit_blocks :]

    # ------------------------------------------------------------ transitions

    def grow(self, num_tokens: int) -> list[KVBlock]:
        """Make room for ``num_tokens`` in total (decode appends); returns new blocks."""
        self._require(AllocationState.PENDING, AllocationState.COMMITTED)
        need = -(-num_tokens // self._pool.block_size) - len(self.blocks)
        added = self._pool.allocate(need) if need > 0 else []
        self.blocks.extend(added)
        self._ids.extend(b.block_id for b in added)
        self.num_tokens = max(self.num_tokens, num_tokens)
        return added

    def commit(self, block_hashes: Sequence[BlockHash] | None = None) -> int:
        """Publish every full block whose hash is known; returns how many entered the index.

        ``block_hashes`` may extend the chain given at allocation (e.g. with full
        blocks that decode produced). Calling it again after more decode publishes
        the new blocks only.
        """
        self._require(AllocationState.PENDING, AllocationState.COMMITTED)
        if block_hashes is not None:
            if list(block_hashes[: len(self.block_hashes)]) != self.block_hashes:
                raise AllocationError("commit hashes must extend the allocation's chain")
            self.block_hashes = list(block_hashes)
        upto = min(len(self.block_hashes), len(self.blocks))
        start = self._num_published
        stored = 0
        if upto > start:
            parent = self.block_hashes[start - 1] if start else None
            stored = self._pool.publish(
                self.blocks[start:upto], self.block_hashes[start:upto], parent
            )
            self._num_published = upto
        self._unpin()
        self.state = AllocationState.COMMITTED
        return stored

    def abort(self) -> None:
        """Return every block and publish nothing. Refcounts end where they began."""
        self._require(AllocationState.PENDING)
        self.state = AllocationState.ABORTED
        self._unpin()
        self._pool.free(reversed(self.blocks))
        self.blocks = []
        self._ids = []

    def free(self) -> None:
        """The request finished: drop our references, chain tail first."""
        self._require(AllocationState.COMMITTED)
        self.state = AllocationState.FREED
        self._pool.free(reversed(self.blocks))
        self.blocks = []
        self._ids = []

    def _unpin(self) -> None:
        pins, self._pins = self._pins, []
        for store, slot in pins:
            store.unpin(slot)

    def close(self) -> None:
        """Abort if pending, free if committed, nothing if already done. Idempotent."""
        if self.state is AllocationState.PENDING:
            self.abort()
        elif self.state is AllocationState.COMMITTED:
            self.free()

    def __enter__(self) -> Allocation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _require(self, *states: AllocationState) -> None:
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise AllocationError(f"allocation is {self.state.value}, expected {allowed}")
