"""A session turn by turn, for `cachepoint-admin sessions`: the four buckets, the cost
against uncached, and for each turn that wrote more than it appended, why (the cache
diagnostics reason in its ledger row) and what that cost.

Pure: rows in, turns out. The command reads the rows and prints the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from cachepoint.billing import Buckets, Price, cost_micros, uncached_cost_micros
from cachepoint.gateway.db.models import UsageRecord


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of the session, as the ledger billed it."""

    index: int  # 1-based, in the order billed
    request_id: str
    model: str
    buckets: Buckets
    cost_micros: int  # what it was billed
    uncached_micros: int  # what it would have cost with no cache
    appended: int  # prompt tokens beyond the previous turn's prompt (all, for the first)
    written: int  # cache writes, 5m and 1h
    reason: str | None  # the ledger's miss_reason (None: not compared)
    missed: int | None  # its cache_missed_input_tokens
    detail: str | None  # what the server knew beyond the reason (an evicted entry's tier)
    break_micros: int  # what writing ``missed`` tokens again cost over reading them

    @property
    def broke(self) -> bool:
        """It wrote more than it appended: part of what it wrote was there before. A
        session's first turn appended all of its prompt; it broke when diagnostics found
        a turn it continues (the same key's last session) and tokens it missed."""
        if self.index == 1:
            return self.reason not in (None, "none") and bool(self.missed)
        return self.written > self.appended


def _buckets(r: UsageRecord) -> Buckets:
    return Buckets(
        r.input_tokens,
        r.cache_read_input_tokens,
        r.cache_write_5m_tokens,
        r.cache_write_1h_tokens,
        r.output_tokens,
    )


def break_cost(missed: int, b: Buckets, price: Price) -> int:
    """Micro-dollars the break cost: ``missed`` tokens written again (at this turn's mix
    of 5m and 1h writes) instead of read."""
    written = b.cache_write_5m_tokens + b.cache_write_1h_tokens
    if missed <= 0 or written == 0:
        return 0
    share_1h = Fraction(b.cache_write_1h_tokens, written)
    write = price.write_5m_mult * (1 - share_1h) + price.write_1h_mult * share_1h
    return round(missed * price.input_per_mtok * (write - price.read_mult) / 1_000_000)


def turns(rows: Sequence[UsageRecord], price_of: Callable[[str], Price]) -> list[Turn]:
    """The session's turns from its ledger rows, oldest first."""
    out: list[Turn] = []
    previous = 0
    for i, r in enumerate(rows, 1):
        b = _buckets(r)
        price = price_of(r.model)
        prompt = b.prompt_tokens
        missed = r.miss_tokens
        out.append(
            Turn(
                index=i,
                request_id=r.request_id,
                model=r.model,
                buckets=b,
                cost_micros=cost_micros(b, price),
                uncached_micros=uncached_cost_micros(b, price),
                appended=max(0, prompt - previous) if i > 1 else prompt,
                written=b.cache_write_5m_tokens + b.cache_write_1h_tokens,
                reason=r.miss_reason,
                missed=missed,
                detail=r.miss_detail,
                break_micros=break_cost(missed or 0, b, price),
            )
        )
        previous = prompt
    return out
