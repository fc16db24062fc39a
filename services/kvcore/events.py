"""Pool events as plain data. The bus schema (a later layer) encodes these for NATS."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A contiguous run of blocks entered the hash index, chained onto ``parent_hash``."""

    block_hashes: tuple[BlockHash, ...]  # in chain order
    parent_hash: BlockHash | None  # hash of the block before the run; None at the root


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the hash index (evicted, or cleared one by one)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole index was dropped; everything stored before this is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
