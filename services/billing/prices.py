"""Prices and the cost of a request's buckets, exact: integer micro-dollars and Fractions.

The gateway bills with these (per model, from the database's price rows); the simulator
takes its multipliers from the same constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from cachepoint.billing.buckets import Buckets

MICROS_PER_USD = 1_000_000
TOKENS_PER_MTOK = 1_000_000

# The cache multipliers of contract §3, on the input price.
READ_MULT = Fraction(1, 10)  # cache_read_input_tokens
WRITE_5M_MULT = Fraction(5, 4)  # a 5m write
WRITE_1H_MULT = Fraction(2)  # a 1h write


@dataclass(frozen=True, slots=True)
class Price:
    """Per model. Base prices in micro-dollars per million tokens; multipliers exact."""

    input_per_mtok: int  # e.g. 3_000_000 for $3 / MTok
    output_per_mtok: int  # generated tokens, likewise
    write_5m_mult: Fraction = WRITE_5M_MULT  # x input price for a 5m write
    write_1h_mult: Fraction = WRITE_1H_MULT  # x input price for a 1h write
    read_mult: Fraction = READ_MULT  # x input price for a cache read


def cost_micros(b: Buckets, p: Price) -> int:
    """Exact rational cost, rounded half-up to whole micro-dollars once per request."""
    exact = (
        Fraction(b.input_tokens * p.input_per_mtok)
        + b.cache_write_5m_tokens * p.input_per_mtok * p.write_5m_mult
        + b.cache_write_1h_tokens * p.input_per_mtok * p.write_1h_mult
        + b.cache_read_input_tokens * p.input_per_mtok * p.read_mult
        + b.output_tokens * p.output_per_mtok
    ) / TOKENS_PER_MTOK
    return int(exact + Fraction(1, 2)) if exact >= 0 else -int(-exact + Fraction(1, 2))


def uncached_cost_micros(b: Buckets, p: Price) -> int:
    """What the same request would cost with no caching at all (for savings reports)."""
    plain = Buckets(b.prompt_tokens, 0, 0, 0, b.output_tokens)
    return cost_micros(plain, p)
