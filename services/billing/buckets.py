"""The token buckets of one request, and how breakpoints' writes split a prompt into them.

Every input token is in exactly one bucket. With A the managed-entry hit, B the last
1h write and C the last write (contract §3, Billing): A tokens are read (0.1x), B - A
are written for 1h (2x), C - max(A, B) are written for 5m (1.25x), and the rest is plain
input (1x). The replica applies that rule to the writes it made (``cache_writes``); the
simulator walks its breakpoints one by one (``walk_breakpoints``); the gateway checks
the replica's report and splits the prompt by it (``buckets``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# NOTE: the TTL labels of the wire and the traces; kvcore's TTL_SECONDS is keyed by them.
TTL_1H = "1h"
TTL_5M = "5m"
# NOTE: every TTL longer than 5 minutes writes into the long bucket, at its price: 1h,
# and OpenAI's 24h retention (docs/openai.md), which has no bucket of its own.


class BillingError(ValueError):
    """The replica's report does not add up; never bill from it."""


@dataclass(frozen=True, slots=True)
class Buckets:
    """Every input token in exactly one bucket."""

    input_tokens: int  # after the last breakpoint, or all when nothing is cached: 1x
    cache_read_input_tokens: int  # up to the managed-entry hit A: 0.1x
    cache_write_5m_tokens: int  # C - max(A, B): 1.25x
    cache_write_1h_tokens: int  # B - A: 2x
    output_tokens: int  # generated

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


def cache_writes(hit: int, written: Sequence[tuple[int, str]]) -> tuple[int, int]:
    """(5m, 1h) written tokens from the hit A and the (position, ttl) entries written:
    with B the last write longer than 5m (1h or 24h) and C the last write,
    1h = B - A and 5m = C - max(A, B).

    Only the writes made are listed (the replica's, past A, ascending); what lies past C,
    a refused write among it, is plain input.
    """
    if not written:
        return 0, 0
    c = max(p for p, _ in written)
    b = max((p for p, ttl in written if ttl != TTL_5M), default=hit)
    return c - max(hit, b), b - hit


def walk_breakpoints(
    prompt_tokens: int,
    read: int,
    marks: Iterable[tuple[int, str, bool]],
    output_tokens: int,
) -> Buckets:
    """The buckets of a prompt from its breakpoints in order, (position, ttl, written).

    Each breakpoint past the read writes from the previous boundary up to itself at its
    own TTL, or, when its write was refused, leaves that span plain input. Everything
    after the last breakpoint is input. The checks of ``buckets`` are left out (the
    simulator validates its trace on load, and this runs once per simulated request).

    NOTE: with the breakpoints ascending, no 1h one after a 5m one (the contract's rule)
    and the refusals a suffix of the writes past the read (the replica's ascending
    writes: each covers the blocks of the one before), this equals ``cache_writes`` on
    the writes made. The simulator needs the walk because it also refuses a breakpoint
    inside the first trace block, with longer writes after it made.
    """
    plain = w5m = w1h = 0
    at = read
    for position, ttl, ok in marks:
        if position <= at:
            continue
        span = position - at
        if not ok:
            plain += span
        elif ttl != TTL_5M:
            w1h += span
        else:
            w5m += span
        at = position
    return Buckets(plain + prompt_tokens - at, read, w5m, w1h, output_tokens)
