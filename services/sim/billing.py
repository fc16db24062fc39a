"""The bill of a simulated request: contract §3's three input buckets, priced.

The split and the multipliers are cachepoint.billing's, the ones the gateway bills
with. NOTE: the sim prices in float dollars, summed over a whole trace: the gateway's
exact Fractions, rounded to micro-dollars per request, would cost a Fraction sum per
simulated request and change the reported totals by that rounding. A float cost is
within a few ulps of the exact one (tests/billing/test_buckets.py bounds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachepoint.billing import READ_MULT, WRITE_1H_MULT, WRITE_5M_MULT, walk_breakpoints
from cachepoint.sim.trace import TraceBreakpoint


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Dollars per million tokens, and the cache multipliers of contract §3."""

    input_per_mtok: float = 3.0  # plain input (an 8B-class model priced like a mid-tier API)
    output_per_mtok: float = 15.0  # generated tokens
    cache_read_mult: float = float(READ_MULT)  # × input price for cache_read_input_tokens
    write_5m_mult: float = float(WRITE_5M_MULT)  # × input price for a 5m write
    write_1h_mult: float = float(WRITE_1H_MULT)  # × input price for a 1h write


@dataclass(slots=True)
class Usage:
    """Token buckets of one request (or a sum of requests)."""

    input_tokens: int = 0  # billed at 1×
    cache_read_input_tokens: int = 0  # billed at the read multiplier
    ephemeral_5m_input_tokens: int = 0  # written with a 5m TTL
    ephemeral_1h_input_tokens: int = 0  # written with a 1h TTL
    output_tokens: int = 0  # generated

    def add(self, other: Usage) -> None:
        self.input_tokens += other.input_tokens
        self.cache_read_input_tokens += other.cache_read_input_tokens
        self.ephemeral_5m_input_tokens += other.ephemeral_5m_input_tokens
        self.ephemeral_1h_input_tokens += other.ephemeral_1h_input_tokens
        self.output_tokens += other.output_tokens

    def cost(self, prices: PriceTable) -> float:
        p_in = prices.input_per_mtok / 1e6
        return (
            self.input_tokens * p_in
            + self.cache_read_input_tokens * p_in * prices.cache_read_mult
            + self.ephemeral_5m_input_tokens * p_in * prices.write_5m_mult
            + self.ephemeral_1h_input_tokens * p_in * prices.write_1h_mult
            + self.output_tokens * prices.output_per_mtok / 1e6
        )

    def output_cost(self, prices: PriceTable) -> float:
        return self.output_tokens * prices.output_per_mtok / 1e6

    def uncached_cost(self, prices: PriceTable) -> float:
        """What the same tokens cost with no caching at all."""
        prompt = (
            self.input_tokens
            + self.cache_read_input_tokens
            + self.ephemeral_5m_input_tokens
            + self.ephemeral_1h_input_tokens
        )
        return (
            prompt * prices.input_per_mtok / 1e6 + self.output_tokens * prices.output_per_mtok / 1e6
        )


def usage_for(
    input_length: int,
    output_length: int,
    read_tokens: int,
    breakpoints: Sequence[TraceBreakpoint],
    written: Sequence[bool],
) -> Usage:
    """Split a prompt into the buckets (cachepoint.billing's ``walk_breakpoints``).

    ``read_tokens`` is the cache read (the longest live entry hit); each breakpoint
    after it writes from the previous boundary up to itself, at its own TTL, unless
    its write was refused (``written`` False), in which case that span is plain
    input. Everything after the last breakpoint is input. Since a 1h marker may
    not follow a 5m one, this is contract §3's "1h write is B−A, 5m write is C−max(A, B)".
    """
    marks = [(bp.tokens, bp.ttl, ok) for bp, ok in zip(breakpoints, written, strict=True)]
    b = walk_breakpoints(input_length, read_tokens, marks, output_length)
    return Usage(
        input_tokens=b.input_tokens,
        cache_read_input_tokens=b.cache_read_input_tokens,
        ephemeral_5m_input_tokens=b.cache_write_5m_tokens,
        ephemeral_1h_input_tokens=b.cache_write_1h_tokens,
        output_tokens=b.output_tokens,
    )
