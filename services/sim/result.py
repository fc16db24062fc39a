"""What one simulation run reports, and the small statistics it needs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in 0..100); NaN when empty."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica over the whole run."""

    name: str  # replica name
    requests: int  # requests it served
    prefill_tokens: int  # tokens it computed in prefill
    cached_tokens: int  # prompt tokens it served from its pool
    busy_s: float  # seconds its prefill engine was busy
    evictions: int  # cached blocks its pool evicted
    indexed_blocks: int  # blocks in the router's index of it at the end


@dataclass(frozen=True, slots=True)
class SimResult:
    """Every figure of one run. `to_json` gives the `cachepoint sim --json` object."""

    trace: str  # trace file
    requests: int  # requests replayed
    replicas: int  # replicas simulated
    capacity_blocks: int  # kvcore blocks per replica
    capacity_frac: float  # capacity per replica as a share of the trace's distinct blocks
    block_size: int  # kvcore tokens per block
    policy: str  # routing policy
    eviction: str  # pool eviction strategy
    retention: str  # "none", "5m", "1h" or "trace"
    time_scale: float  # trace time multiplier
    event_delay_s: float  # events' propagation delay to the router
    seed: int  # seed of every random choice
    hit_ratio: float  # prefix blocks served from cache / prefix blocks (trace blocks)
    token_hit_ratio: float  # prompt tokens served from cache / prompt tokens
    bound: float  # infinite-cache bound: share of prefix blocks seen before
    token_bound: float  # the same in tokens
    ratio_to_bound: float  # hit_ratio / bound
    ttft_p50_s: float  # time to first token, median
    ttft_p90_s: float  # 90th percentile
    ttft_p99_s: float  # 99th percentile
    ttft_mean_s: float  # mean
    queue_p50_s: float  # time waiting for the prefill engine, median
    queue_p90_s: float  # 90th percentile
    queue_p99_s: float  # 99th percentile
    queue_mean_s: float  # mean
    load_imbalance: float  # max / mean of per-replica prefill busy time (1.0 = even)
    load_cv: float  # coefficient of variation of per-replica prefill busy time
    billed_cost: float  # dollars billed under the price table
    uncached_cost: float  # dollars the same traffic costs with no caching
    cost_saving: float  # 1 - billed / uncached, on the whole bill (output included)
    input_cost_saving: float  # the same on the prompt's share of the bill only
    input_tokens: int  # billed as plain input
    cache_read_input_tokens: int  # billed as cache reads
    cache_creation_input_tokens: int  # billed as writes (5m + 1h)
    rejected: int  # requests no replica could take (queue bound, or larger than a pool)
    evictions: int  # cached blocks evicted over all pools
    retain_refusals: int  # retentions refused by the retained-share cap
    events: int  # kv events the router applied
    event_blocks: int  # block hashes those events carried
    sim_time_s: float  # simulated seconds from first arrival to last completion
    elapsed_s: float  # wall seconds the replay took (trace loading and hashing excluded)
    prepare_s: float  # wall seconds spent loading and hashing the trace
    per_replica: tuple[ReplicaStats, ...]  # one entry per replica
    ttft_s: tuple[float, ...]  # every served request's TTFT, ascending (for CDF plots)
    host_frac: float = 0.0  # host tier per replica, share of the distinct blocks (0: none)
    disk_frac: float = 0.0  # disk tier per replica, likewise
    host_slots: int = 0  # host tier slots per replica, in kvcore blocks
    disk_slots: int = 0  # disk tier slots per replica
    # share of all prefix blocks (as in hit_ratio) served from each tier; sums to hit_ratio
    hit_ratio_by_tier: dict[str, float] = field(default_factory=dict)
    # per lower tier, summed over replicas: kvcore's counters (hits, promotions, demotions,
    # evictions, dropped, failed_copies) and the bytes promoted out of / demoted into it
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    promoted_requests: int = 0  # requests that promoted at least one block
    promote_p50_s: float = math.nan  # of those, seconds the prefill waited for promotions
    promote_p90_s: float = math.nan  # 90th percentile
    promote_max_s: float = math.nan  # the longest wait
    link_busy: dict[str, float] = field(default_factory=dict)  # mean share of time busy, by link

    def to_json(self, *, full: bool = False) -> dict[str, Any]:
        """The flat JSON object; ``full`` adds the per-replica table and every TTFT."""
        out = asdict(self)
        if not full:
            out.pop("ttft_s")
            out["per_replica"] = [
                {"name": r.name, "requests": r.requests, "busy_s": r.busy_s}
                for r in self.per_replica
            ]
        return {k: _finite(v) for k, v in out.items()}


def _finite(value: Any) -> Any:
    # NOTE: JSON has no NaN; a run with no served request reports null instead.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
