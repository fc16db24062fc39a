"""``GET /v1/stats``: a replica's pool, cache and queue, as the gateway polls it while
the event plane is down (and as operators read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from cachepoint.protocol.response import RetentionMode


class BlockStats(BaseModel):
    total: int
    active: int
    cached_free: int
    empty: int
    retained: int
    max_retained: int
    retained_owners: int = 0  # tenants holding at least one retained block


class TierStatsOut(BaseModel):
    """One KV tier behind the device pool; counters are ever since the epoch began."""

    tier: str  # "host" or "disk"
    slots: int  # capacity in blocks
    bytes: int  # capacity in bytes, all TP ranks together
    used: int  # blocks held (visible, or in flight)
    visible: int  # blocks a prefix can hit
    retained: int  # TTL-retained blocks here now
    max_retained: int  # this tier's retained cap
    hit_blocks: int  # blocks hit here (promotions started)
    promoted_blocks: int  # blocks that moved up into the device index
    demoted_blocks: int  # blocks whose copy into this tier completed
    evicted_blocks: int  # blocks pushed out (down a tier, or dropped)
    dropped_blocks: int  # of those, lost from every tier
    failed_copies: int  # copies into this tier that failed


class StatsResponse(BaseModel):
    replica: str
    epoch: int
    model: str
    block_size: int
    max_model_len: int
    blocks: BlockStats
    entries: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int
    retain_refusals: int
    quota_refusals: int = 0  # of retain_refusals, refused by a tenant's retention quota
    waiting: int
    running: int
    queued_prefill_tokens: int
    max_waiting: int
    preemptions: int = 0  # running sequences requeued to recompute (KV full), ever
    tiers: list[TierStatsOut] = []  # host and disk tiers behind the device pool, if any
    copied_blocks: int = 0  # blocks copied between tiers by the engine, ever
    copy_seconds: float = 0.0  # engine time spent on those copies, ever
    draining: bool = False  # going away: the gateway routes nothing new here
    engine: Literal["torch", "vllm"] = "torch"  # what computes the KV
    lapsed_entries: int = 0  # entries whose blocks the engine evicted before the TTL, ever
    # guaranteed: written entries keep their blocks until the TTL; best_effort: the
    # engine may evict them sooner (vLLM without its retention connector)
    retention: RetentionMode = "guaranteed"
    pinned_blocks: int | None = None  # vLLM: blocks its retention connector holds now
    # vLLM: seconds the retention connector spent in vLLM's scheduler, ever (its cost)
    connector_seconds: float | None = None
    # vLLM: block retentions the ledger let run out, ever (each pin released at its TTL)
    expired_retentions: int | None = None
