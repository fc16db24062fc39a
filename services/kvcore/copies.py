"""BlockCopy: one block's bytes to move between tiers, as the engine will run it."""

from __future__ import annotations

from dataclasses import dataclass

from .hashing import BlockHash
from .tier import Tier


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one block from ``src`` to ``dst``.

    Copies are queued in causal order and must run in that order: a slot a demotion
    reads from may be the destination of a later copy in the same batch.
    """

    block_hash: BlockHash  # the block's chain hash
    src_tier: Tier  # where the bytes are now
    src_index: int  # device block id, or slot number in a lower tier
    dst_tier: Tier  # where they go
    dst_index: int  # device block id, or slot number in a lower tier

    @property
    def is_promotion(self) -> bool:
        """Towards the device (a hit being brought up), rather than a demotion."""
        return self.dst_tier is Tier.DEVICE
