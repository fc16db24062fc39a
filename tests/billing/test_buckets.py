"""cachepoint.billing: the buckets, the A/B/C write split and the exact cost (contract §3).

The first four tests moved here from tests/gateway/test_billing.py with the arithmetic.
The rest pin what the three users share: the replica's ``cache_writes`` and the
simulator's ``walk_breakpoints`` agree where both apply, and the simulator's float
cost is the gateway's exact cost up to float rounding.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepoint.billing import (
    READ_MULT,
    WRITE_1H_MULT,
    WRITE_5M_MULT,
    BillingError,
    Buckets,
    Price,
    buckets,
    cache_writes,
    cost_micros,
    uncached_cost_micros,
    walk_breakpoints,
)
from cachepoint.sim.billing import PriceTable, Usage, usage_for
from cachepoint.sim.trace import TraceBreakpoint

PRICE = Price(input_per_mtok=3_000_000, output_per_mtok=15_000_000)


@st.composite
def reports(draw):
    n = draw(st.integers(1, 200_000))
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))  # last 1h breakpoint
    c = draw(st.integers(b, n))  # last breakpoint
    out = draw(st.integers(0, 8192))
    return n, a, c - b, b - a, out


@given(reports())
def test_billing_buckets_partition_the_prompt(r):
    n, read, w5, w1, out = r
    b = buckets(n, read, w5, w1, out)
    assert (
        min(
            b.input_tokens,
            b.cache_read_input_tokens,
            b.cache_write_5m_tokens,
            b.cache_write_1h_tokens,
        )
        >= 0
    )
    assert b.prompt_tokens == n
    assert b.cache_creation_input_tokens == w5 + w1


@given(reports(), st.integers(0, 50_000_000), st.integers(0, 100_000_000))
def test_billing_cost_equals_the_formula(r, inp, outp):
    n, read, w5, w1, out = r
    p = Price(inp, outp)
    b = buckets(n, read, w5, w1, out)
    exact = (
        Fraction(b.input_tokens) * inp
        + Fraction(5, 4) * w5 * inp
        + 2 * w1 * inp
        + Fraction(1, 10) * read * inp
        + out * outp
    ) / 1_000_000
    got = cost_micros(b, p)
    assert isinstance(got, int)
    assert abs(got - exact) <= Fraction(1, 2)
    assert got <= uncached_cost_micros(b, p) or w5 + w1 > 0  # only writes cost more


def test_billing_worked_example():
    # 1000 read, 500 written 1h, 300 written 5m, 200 plain, 100 out, at $3 / $15.
    b = buckets(2000, 1000, 300, 500, 100)
    expected = 200 * 3 + 300 * 3.75 + 500 * 6 + 1000 * 0.3 + 100 * 15  # micro-dollars
    assert cost_micros(b, PRICE) == expected == 6525


def test_billing_rejects_impossible_reports():
    with pytest.raises(BillingError, match="covers"):
        buckets(10, 8, 5, 0, 0)
    with pytest.raises(BillingError, match="negative"):
        buckets(10, -1, 0, 0, 0)


# ----------------------------------------------------------------- the A/B/C write split


def test_cache_writes_split_a_b_c():
    # A = 1000 read; B = 3000 the last 1h write; C = 5000 the last write.
    assert cache_writes(1000, [(2000, "1h"), (3000, "1h"), (5000, "5m")]) == (2000, 2000)
    assert cache_writes(1000, [(4000, "5m")]) == (3000, 0)  # no 1h write: B = A
    assert cache_writes(0, [(300, "1h")]) == (0, 300)
    assert cache_writes(700, []) == (0, 0)  # nothing written: all read or plain


def test_walk_breakpoints_bills_a_refused_span_as_plain_input():
    # The first write refused (inside the first trace block, in the simulator), the
    # second made: only the span from the refused boundary on is a write.
    b = walk_breakpoints(1000, 0, [(100, "5m", False), (600, "5m", True)], 7)
    assert b == Buckets(100 + 400, 0, 500, 0, 7)
    assert b.prompt_tokens == 1000
    # cache_writes, given the one write made, would bill all 600 as written: the two
    # rules differ only off the replica's ascending, suffix-refused writes.
    assert cache_writes(0, [(600, "5m")]) == (600, 0)


@st.composite
def plans(draw):
    """A prompt, its read A and ascending breakpoints (no 1h after a 5m), the writes
    past A made up to a refusal and refused from there on, as the replica's are."""
    n = draw(st.integers(1, 200_000))
    positions = sorted(draw(st.lists(st.integers(1, n), max_size=4)))
    n_1h = draw(st.integers(0, len(positions)))
    ttls = ["1h"] * n_1h + ["5m"] * (len(positions) - n_1h)
    read = draw(st.sampled_from([0, *positions]))
    past = [(p, t) for p, t in zip(positions, ttls, strict=True) if p > read]
    made = draw(st.integers(0, len(past)))
    return n, read, positions, ttls, past[:made], draw(st.integers(0, 8192))


@given(plans())
def test_walk_equals_cache_writes_on_the_replicas_writes(plan):
    n, read, positions, ttls, written, out = plan
    made = set(written)
    marks = [(p, t, p <= read or (p, t) in made) for p, t in zip(positions, ttls, strict=True)]
    w5m, w1h = cache_writes(read, written)
    assert walk_breakpoints(n, read, marks, out) == buckets(n, read, w5m, w1h, out)


# ------------------------------------------------------------ the simulator on the same


def test_sim_prices_use_the_gateway_multipliers():
    table, price = PriceTable(), Price(1, 1)
    assert (price.read_mult, price.write_5m_mult, price.write_1h_mult) == (
        READ_MULT,
        WRITE_5M_MULT,
        WRITE_1H_MULT,
    )
    assert table.cache_read_mult == float(READ_MULT)
    assert table.write_5m_mult == float(WRITE_5M_MULT)
    assert table.write_1h_mult == float(WRITE_1H_MULT)


# NOTE: the simulator sums float dollars (speed, and totals over a whole trace). Every
# term is non-negative, so the float sum is within a relative 2**-53 per rounding of the
# exact one: about a dozen roundings (the table's price, the price over 1e6, three
# products per term, four additions), bounded here with room at 1e-14. Against the
# gateway's bill, which rounds the exact cost once to whole micro-dollars, that adds at
# most half a micro-dollar.
REL = 1e-14


def _usage(b: Buckets) -> Usage:
    return Usage(
        b.input_tokens,
        b.cache_read_input_tokens,
        b.cache_write_5m_tokens,
        b.cache_write_1h_tokens,
        b.output_tokens,
    )


@given(reports(), st.integers(0, 50_000_000), st.integers(0, 100_000_000))
def test_sim_cost_equals_the_gateway_cost(r, inp, outp):
    n, read, w5, w1, out = r
    b = buckets(n, read, w5, w1, out)
    price = Price(inp, outp)  # micro-dollars per MTok
    table = PriceTable(input_per_mtok=inp / 1e6, output_per_mtok=outp / 1e6)  # dollars
    exact = (
        Fraction(b.input_tokens * inp)
        + b.cache_write_5m_tokens * inp * WRITE_5M_MULT
        + b.cache_write_1h_tokens * inp * WRITE_1H_MULT
        + b.cache_read_input_tokens * inp * READ_MULT
        + b.output_tokens * outp
    ) / 1_000_000  # micro-dollars, unrounded
    sim = _usage(b).cost(table) * 1_000_000
    assert abs(Fraction(sim) - exact) <= REL * exact
    # The gateway's bill: the exact cost rounded once to whole micro-dollars.
    assert abs(sim - cost_micros(b, price)) <= 0.5 + REL * float(exact)
    uncached = _usage(b).uncached_cost(table) * 1_000_000
    assert abs(uncached - uncached_cost_micros(b, price)) <= 0.5 + REL * uncached


def test_sim_usage_for_is_the_shared_walk():
    bps = (TraceBreakpoint(2000, "1h"), TraceBreakpoint(3000, "1h"), TraceBreakpoint(5000, "5m"))
    u = usage_for(6000, 10, 1000, bps, [True, False, True])
    b = walk_breakpoints(
        6000, 1000, [(2000, "1h", True), (3000, "1h", False), (5000, "5m", True)], 10
    )
    assert (
        (
            u.input_tokens,
            u.cache_read_input_tokens,
            u.ephemeral_5m_input_tokens,
            u.ephemeral_1h_input_tokens,
            u.output_tokens,
        )
        == (
            b.input_tokens,
            b.cache_read_input_tokens,
            b.cache_write_5m_tokens,
            b.cache_write_1h_tokens,
            b.output_tokens,
        )
        == (1000 + 1000, 1000, 2000, 1000, 10)
    )


def test_billing_imports_no_service_and_no_torch():
    code = (
        "import sys, cachepoint.billing; "
        "print(sorted(m for m in sys.modules if m == 'torch' or (m.startswith('cachepoint.') "
        "and not m.startswith(('cachepoint.billing', 'cachepoint.kvcore')))))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
