"""What a lower-tier hit is worth to the router: its transfer time against recompute.

A block found in a replica's host memory (or on its disk) is copied to the device
before prefill instead of being recomputed. It saves the prefill of its tokens but
costs the copy, so it is worth ``max(0, 1 − transfer / recompute)`` of a device hit:

    transfer  = kv_bytes_per_token / read_bytes_per_s   (seconds per token)
    recompute = 1 / prefill_tokens_per_s                 (seconds per token)

Pure: the gateway fills a `TierValue` from each heartbeat and the simulator from its
tier model; the routing policies multiply lower-tier hits by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_HOST_VALUE = 0.5
"""A host hit's worth when the replica does not report its cost model.

NOTE: conservative on purpose. On the hardware the tiers are built for (PCIe Gen5,
an 8B model on an H200) a host hit is worth more than 0.9 of a device hit, but a
replica that reports no figures may be anything; overpricing sends a request where
the copy takes longer than recompute elsewhere. Half still beats a miss and still
loses to a device hit, and it is one heartbeat field away from the measured value.
"""

DEFAULT_DISK_VALUE = 0.25
"""A disk hit's worth when the replica does not report its cost model (NVMe read
bandwidth spans 1 to 14 GB/s, so even less is known than for host memory)."""


@dataclass(frozen=True, slots=True)
class TierValue:
    """What a hit in each lower tier saves on one replica, as a share of a device hit."""

    host: float = DEFAULT_HOST_VALUE  # a host-memory hit, in [0, 1]
    disk: float = DEFAULT_DISK_VALUE  # a local-disk hit, in [0, 1]

    def __post_init__(self) -> None:
        for name in ("host", "disk"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0):
                raise ValueError(f"{name} tier value must be within [0, 1], got {v!r}")


DEVICE_EQUIVALENT = TierValue(1.0, 1.0)
"""Every lower-tier hit counted as a device hit (free transfers; tests and what-ifs)."""


def _known(x: float) -> bool:
    return math.isfinite(x) and x > 0


def lower_hit_value(
    kv_bytes_per_token: float,
    prefill_tokens_per_s: float,
    read_bytes_per_s: float,
    default: float,
) -> float:
    """``max(0, 1 − transfer/recompute)`` for one tier; ``default`` when a figure is unknown
    (zero, negative, NaN or infinite: a heartbeat's 0 means "not reported")."""
    if not (
        _known(kv_bytes_per_token) and _known(prefill_tokens_per_s) and _known(read_bytes_per_s)
    ):
        return default
    # transfer/recompute = (bytes/token ÷ bytes/s) ÷ (1 ÷ tokens/s)
    ratio = kv_bytes_per_token * prefill_tokens_per_s / read_bytes_per_s
    return max(0.0, 1.0 - ratio)


def tier_value(
    kv_bytes_per_token: float,
    prefill_tokens_per_s: float,
    host_read_bytes_per_s: float,
    disk_read_bytes_per_s: float,
) -> TierValue:
    """A replica's `TierValue` from its heartbeat's cost model (see the module doc)."""
    return TierValue(
        host=lower_hit_value(
            kv_bytes_per_token, prefill_tokens_per_s, host_read_bytes_per_s, DEFAULT_HOST_VALUE
        ),
        disk=lower_hit_value(
            kv_bytes_per_token, prefill_tokens_per_s, disk_read_bytes_per_s, DEFAULT_DISK_VALUE
        ),
    )
