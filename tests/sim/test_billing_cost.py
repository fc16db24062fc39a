"""The bill's buckets and the replica cost model."""

from __future__ import annotations

import pytest

from cachepoint.sim.billing import PriceTable, Usage, usage_for
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.trace import TraceBreakpoint


def test_mixed_ttl_buckets_follow_design_section_3():
    # A = 1000 read; B = 3000 the last 1h breakpoint; C = 5000 the last breakpoint.
    bps = (TraceBreakpoint(2000, "1h"), TraceBreakpoint(3000, "1h"), TraceBreakpoint(5000, "5m"))
    u = usage_for(6000, 10, 1000, bps, [True, True, True])
    assert u.cache_read_input_tokens == 1000
    assert u.ephemeral_1h_input_tokens == 2000  # B - A
    assert u.ephemeral_5m_input_tokens == 2000  # C - B
    assert u.input_tokens == 1000  # after C
    assert u.output_tokens == 10


def test_refused_write_is_billed_as_plain_input():
    u = usage_for(4000, 0, 0, (TraceBreakpoint(4000, "5m"),), [False])
    assert (u.input_tokens, u.ephemeral_5m_input_tokens) == (4000, 0)


def test_breakpoints_at_or_before_the_read_are_not_written_again():
    u = usage_for(
        4000, 0, 3000, (TraceBreakpoint(2000, "5m"), TraceBreakpoint(4000, "5m")), [True, True]
    )
    assert (u.cache_read_input_tokens, u.ephemeral_5m_input_tokens, u.input_tokens) == (
        3000,
        1000,
        0,
    )


def test_prices_apply_the_multipliers():
    p = PriceTable(input_per_mtok=1.0, output_per_mtok=10.0)
    u = Usage(1_000_000, 1_000_000, 1_000_000, 1_000_000, 1_000_000)
    assert u.cost(p) == pytest.approx(1 + 0.1 + 1.25 + 2.0 + 10)
    assert u.uncached_cost(p) == pytest.approx(4 + 10)
    total = Usage()
    total.add(u)
    total.add(u)
    assert total.cost(p) == pytest.approx(2 * u.cost(p))


def test_cost_model_flops_and_times():
    m = ReplicaCostModel()
    assert (
        m.kv_bytes_per_token == 128 * 1024
    )  # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 x 2 B
    # attention over keys: positions 0..n-1 attend to 1..n keys
    n = 1000
    attention = m.num_layers * 4 * m.num_heads * m.head_dim * (n * (n + 1) // 2)
    lm_head = 2 * m.hidden_size * m.vocab_size
    assert m.prefill_flops(n, 0) == pytest.approx(
        m.linear_flops_per_token * n + attention + lm_head
    )
    cold, warm = m.prefill_s(8192, 0), m.prefill_s(192, 8000)
    assert warm < cold / 10
    assert 0.1 < cold < 1.0  # an 8B model on an H100 prefills 8k tokens in a few hundred ms
    assert m.decode_step_s(100_000) > m.decode_step_s(0) > m.step_overhead_s
