from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepoint.gateway.contract.billing import (
    BillingError,
    Price,
    buckets,
    cost_micros,
    uncached_cost_micros,
)

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
