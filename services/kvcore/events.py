"""Pool events as plain data. The bus schema (a later layer) encodes these for NATS."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import BlockHash
from .tier import Tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A contiguous run of blocks became visible for hits in ``tier``.

    Lower tiers hold single blocks, not chains, so their runs have no parent.
    """

    block_hashes: tuple[BlockHash, ...]  # in chain order
    parent_hash: BlockHash | None  # hash of the block before the run; None at the root
    tier: Tier = Tier.DEVICE  # where the blocks can now be hit


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left ``tier``'s index (evicted, demoted, promoted out, or cleared)."""

    block_hashes: tuple[BlockHash, ...]
    tier: Tier = Tier.DEVICE  # the tier they left


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every tier's index was dropped; everything stored before this is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
