"""GET /v1/stats: the pool, the hit counters and the queue, for the gateway and operator."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from cachepoint.protocol import BlockStats, StatsResponse, TierStatsOut
from cachepoint.replica.api.deps import SchedulerDep, require_internal_token

router = APIRouter(tags=["stats"], dependencies=[Depends(require_internal_token)])


@router.get("/v1/stats", response_model=StatsResponse)
async def stats(scheduler: SchedulerDep) -> StatsResponse:
    st = scheduler.cache_stats()
    b = st.blocks
    return StatsResponse(
        replica=scheduler.name,
        epoch=scheduler.epoch,
        model=scheduler.model,
        block_size=scheduler.block_size,
        max_model_len=scheduler.max_model_len,
        blocks=BlockStats(
            total=b.total,
            active=b.active,
            cached_free=b.cached_free,
            empty=b.empty,
            retained=b.retained,
            max_retained=b.max_retained,
            retained_owners=b.retained_owners,
        ),
        entries=st.entries,
        query_tokens=st.query_tokens,
        hit_tokens=st.hit_tokens,
        hit_rate=st.hit_tokens / st.query_tokens if st.query_tokens else 0.0,
        evictions=st.evictions,
        retain_refusals=st.retain_refusals,
        quota_refusals=st.quota_refusals,
        waiting=len(scheduler.waiting),
        running=len(scheduler.running),
        queued_prefill_tokens=scheduler.queued_prefill_tokens,
        max_waiting=scheduler.settings.max_waiting,
        preemptions=scheduler.preemptions,
        tiers=[
            TierStatsOut(
                tier=str(t.tier),
                slots=t.slots,
                bytes=t.slots * scheduler.block_bytes,
                used=t.used,
                visible=t.visible,
                retained=t.retained,
                max_retained=t.max_retained,
                hit_blocks=t.hits,
                promoted_blocks=t.promotions,
                demoted_blocks=t.demotions,
                evicted_blocks=t.evictions,
                dropped_blocks=t.dropped,
                failed_copies=t.failed_copies,
            )
            for t in st.tiers
        ],
        copied_blocks=scheduler.copied_blocks,
        copy_seconds=scheduler.copy_s,
        draining=scheduler.draining,
        engine=scheduler.settings.engine,
        lapsed_entries=scheduler.lapsed_entries,
        retention=scheduler.retention,
        pinned_blocks=scheduler.pinned_blocks,
        connector_seconds=scheduler.connector_seconds,
        expired_retentions=scheduler.expired_retentions,
    )
