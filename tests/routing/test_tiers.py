"""Routing over KV tiers: a lower-tier hit is priced by its transfer time against recompute."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from cachepoint.kvcore import BlockHash, BlockStored, PrefixIndex, Tier, hash_blocks
from cachepoint.routing import (
    DEVICE_EQUIVALENT,
    CacheAwarePolicy,
    PrefixAffinityPolicy,
    ReplicaView,
    TierValue,
    lower_hit_value,
    make_policy,
    tier_value,
)
from cachepoint.routing.costs import DEFAULT_DISK_VALUE, DEFAULT_HOST_VALUE

BS = 16
KV = 128 * 1024  # bytes of one token's KV (Llama-3-8B)


def prompt(session: int, blocks: int) -> list[BlockHash]:
    tokens = [session * 10_000 + i for i in range(blocks * BS)]
    return hash_blocks(tokens, BS, ("model",))


def view(
    name: str,
    device: Sequence[BlockHash] = (),
    host: Sequence[BlockHash] = (),
    disk: Sequence[BlockHash] = (),
    value: TierValue | None = None,
    **load: int,
) -> ReplicaView:
    index = PrefixIndex(device)
    if host:
        index.apply(BlockStored(tuple(host), None, Tier.HOST))
    if disk:
        index.apply(BlockStored(tuple(disk), None, Tier.DISK))
    v = ReplicaView(name, index, **load)  # type: ignore[arg-type]
    if value is not None:
        v.tier_value = value
    return v


def test_tier_value_is_one_minus_transfer_over_recompute():
    # 128 KiB a token over 50 GB/s is 2.6 us; recompute at 10k tokens/s is 100 us.
    assert lower_hit_value(KV, 10_000, 50e9, 0.5) == pytest.approx(1 - KV * 10_000 / 50e9)
    tv = tier_value(KV, 10_000, 50e9, 2e9)
    assert tv.host == pytest.approx(0.9738, abs=1e-4)
    assert tv.disk == pytest.approx(1 - KV * 10_000 / 2e9)  # 0.345
    # A copy slower than recompute is worth nothing, never a negative saving.
    assert lower_hit_value(KV, 10_000, 1e9, 0.5) == 0.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_unreported_cost_figures_fall_back_to_conservative_defaults(bad: float):
    assert tier_value(0, 0, 0, 0) == TierValue(DEFAULT_HOST_VALUE, DEFAULT_DISK_VALUE)
    assert tier_value(KV, bad, 50e9, 2e9) == TierValue()
    assert tier_value(KV, 10_000, bad, 2e9).host == DEFAULT_HOST_VALUE
    assert tier_value(KV, 10_000, 50e9, bad).disk == DEFAULT_DISK_VALUE
    assert 0 < DEFAULT_DISK_VALUE < DEFAULT_HOST_VALUE < 1


def test_tier_value_refuses_shares_outside_zero_one():
    with pytest.raises(ValueError, match="host tier value must be within"):
        TierValue(host=1.5)
    with pytest.raises(ValueError, match="disk tier value must be within"):
        TierValue(disk=math.nan)


@pytest.mark.parametrize("name", ["cache_aware", "prefix_affinity"])
def test_device_hit_beats_host_hit_beats_miss(name: str):
    session = prompt(7, 8)
    longer = prompt(7, 9)
    half = TierValue(host=0.5, disk=0.25)
    device = view("device", session, value=half)
    host = view("host", host=session, value=half)
    miss = view("miss", value=half)
    decision = make_policy(name).choose(longer, [miss, host, device], BS)
    assert decision.replica == "device"
    scores = {c.replica: c for c in decision.candidates}
    assert scores["host"].matched_blocks == 8  # the hit, whatever its tier
    assert scores["host"].matched_tokens == 8 * BS
    assert scores["host"].saved_tokens == 0.5 * 8 * BS  # priced
    assert (scores["host"].host_blocks, scores["host"].disk_blocks) == (8, 0)
    assert scores["device"].saved_tokens == 8 * BS
    # Without the device holder the host holder wins over a miss.
    assert make_policy(name).choose(longer, [miss, host], BS).replica == "host"


def test_disk_hit_counts_by_its_own_value():
    session = prompt(3, 8)
    value = TierValue(host=0.9, disk=0.2)
    on_host = view("host", host=session[4:], device=session[:4], value=value)
    on_disk = view("disk", disk=session[4:], device=session[:4], value=value)
    decision = CacheAwarePolicy().choose(session, [on_disk, on_host], BS)
    assert decision.replica == "host"
    c = {c.replica: c for c in decision.candidates}
    assert c["disk"].saved_tokens == pytest.approx((4 + 0.2 * 4) * BS)
    assert c["host"].saved_tokens == pytest.approx((4 + 0.9 * 4) * BS)
    assert (c["disk"].host_blocks, c["disk"].disk_blocks, c["disk"].matched_blocks) == (0, 4, 8)


def test_host_hit_slower_than_recompute_counts_as_nothing():
    session = prompt(5, 8)
    slow_link = tier_value(KV, 20_000, 1e9, 0)  # 131 us to copy a token, 50 us to compute it
    assert slow_link.host == 0.0
    holder = view("holder", host=session, value=slow_link, queued_prefill_tokens=1)
    idle = view("idle", value=slow_link)
    decision = CacheAwarePolicy(tie_tolerance=0).choose(session, [holder, idle], BS)
    assert decision.replica == "idle"
    c = {c.replica: c for c in decision.candidates}
    assert c["holder"].saved_tokens == 0.0
    assert c["holder"].matched_blocks == 8  # still reported as the hit it is
    # The same holder with a fast link wins despite its queued token.
    holder.tier_value = tier_value(KV, 20_000, 50e9, 0)
    assert CacheAwarePolicy(tie_tolerance=0).choose(session, [holder, idle], BS).replica == (
        "holder"
    )


def test_host_hit_priced_device_equivalent_scores_like_a_device_hit():
    session = prompt(6, 6)
    host = view("host", host=session, value=DEVICE_EQUIVALENT)
    device = view("device", session)
    cands = CacheAwarePolicy().choose(session, [host, device], BS).candidates
    assert cands[0].score == cands[1].score == 6 * BS


def test_prefix_affinity_prefers_the_device_holder_when_the_fleet_holds_it_below():
    # Most replicas hold the session only in host memory: by blocks it looks common
    # (cold: least loaded); by priced saving the device holder is still the best.
    session = prompt(9, 8)
    value = TierValue(host=0.5)
    fleet = [view(f"h{i}", host=session, value=value) for i in range(3)]
    device = view("device", session, value=value, queued_prefill_tokens=100)
    decision = PrefixAffinityPolicy().choose(session, [*fleet, device], BS)
    assert decision.replica == "device"


def test_decision_reports_tiers_in_the_route_span():
    session = prompt(4, 6)
    holder = view("a", device=session[:2], host=session[2:5], disk=session[5:])
    decision = CacheAwarePolicy().choose(session, [holder, view("b")], BS)
    assert (decision.matched_blocks, decision.host_blocks, decision.disk_blocks) == (6, 3, 1)
    attrs = decision.span_attributes()
    assert (attrs["cachepoint.route.host_blocks"], attrs["cachepoint.route.disk_blocks"]) == (3, 1)
    assert attrs["cachepoint.route.matched_tokens"] == 6 * BS
    candidates = attrs["cachepoint.route.candidates"]
    assert isinstance(candidates, list)
    assert candidates[0].endswith(",host=3,disk=1")
    assert candidates[1] == "b:matched=0,load=0,score=0"  # device-only line unchanged
