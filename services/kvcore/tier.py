"""The memory tiers a replica's KV blocks can live in, fastest first."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    """Where a block's KV lives. Values are the wire and metric names."""

    DEVICE = "device"  # the accelerator's pool: the only tier attention reads
    HOST = "host"  # host DRAM behind the device (pinned on GPUs)
    DISK = "disk"  # memory-mapped files on node-local storage


TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)
