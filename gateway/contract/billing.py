"""The three token buckets and their cost, in integer micro-dollars (contract §3, Billing)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MICROS_PER_USD = 1_000_000
TOKENS_PER_MTOK = 1_000_000


class BillingError(ValueError):
    """The replica's report does not add up; never bill from it."""


@dataclass(frozen=True, slots=True)
class Buckets:
    """Every input token in exactly one bucket."""

    input_tokens: int  # after the last breakpoint, or all when nothing is cached: 1x
    cache_read_input_tokens: int  # up to the managed-entry hit A: 0.1x
    cache_write_5m_tokens: int  # C - max(A, B): 1.25x
    cache_write_1h_tokens: int  # B - A: 2x
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return (
            self.input_tokens
            + self.cache_read_input_tokens
            + self.cache_write_5m_tokens
            + self.cache_write_1h_tokens
        )

    @property
    def cache_creation_input_tokens(self) -> int:
        return self.cache_write_5m_tokens + self.cache_write_1h_tokens


def buckets(
    prompt_tokens: int, read: int, write_5m: int, write_1h: int, output_tokens: int
) -> Buckets:
    """Split a prompt by the replica's cache report. Tokens the engine reused without a
    marker are not in ``read``: the marker is what buys the discount."""
    if min(prompt_tokens, read, write_5m, write_1h, output_tokens) < 0:
        raise BillingError("negative token count in the cache report")
    plain = prompt_tokens - read - write_5m - write_1h
    if plain < 0:
        covered = read + write_5m + write_1h
        raise BillingError(f"cache report covers {covered} of a {prompt_tokens}-token prompt")
    return Buckets(plain, read, write_5m, write_1h, output_tokens)


@dataclass(frozen=True, slots=True)
class Price:
    """Per model. Base prices in micro-dollars per million tokens; multipliers exact."""

    input_per_mtok: int  # e.g. 3_000_000 for $3 / MTok
    output_per_mtok: int
    write_5m_mult: Fraction = Fraction(5, 4)
    write_1h_mult: Fraction = Fraction(2)
    read_mult: Fraction = Fraction(1, 10)


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
