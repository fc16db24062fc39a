"""Billing arithmetic: the token buckets of a request and their price (contract §3, Billing).

One home for the numbers the gateway bills, the replica reports, the simulator sums and
the demo prints. Pure and torch-free; it imports nothing of ours but kvcore (an
import-linter contract in pyproject.toml).
"""

from cachepoint.billing.buckets import (
    BillingError,
    Buckets,
    buckets,
    cache_writes,
    walk_breakpoints,
)
from cachepoint.billing.prices import (
    MICROS_PER_USD,
    READ_MULT,
    TOKENS_PER_MTOK,
    WRITE_1H_MULT,
    WRITE_5M_MULT,
    Price,
    cost_micros,
    uncached_cost_micros,
)

__all__ = [
    "MICROS_PER_USD",
    "READ_MULT",
    "TOKENS_PER_MTOK",
    "WRITE_1H_MULT",
    "WRITE_5M_MULT",
    "BillingError",
    "Buckets",
    "Price",
    "buckets",
    "cache_writes",
    "cost_micros",
    "uncached_cost_micros",
    "walk_breakpoints",
]
