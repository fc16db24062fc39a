"""A preempted sequence is not readmitted into a pool that would preempt it again at
once: each recompute costs its whole context, so ping-pong must not happen."""

from __future__ import annotations

import asyncio
import random

import pytest

from cachepoint.scheduler.scheduler import Scheduler
from cachepoint.scheduler.schemas import GenerateRequest
from cachepoint.scheduler.settings import ReplicaSettings

from .test_preemption_load import MAX_TOKENS, POOL_BLOCKS, PROMPT, REQUESTS, WAIT_S, _engine


async def _run(headroom: int) -> tuple[int, list[list[int]]]:
    settings = ReplicaSettings(
        name="r-headroom", max_num_batched_tokens=256, readmit_headroom_tokens=headroom
    )
    s = Scheduler(_engine(POOL_BLOCKS), settings)
    s.start()
    try:
        seqs = []
        for i in range(REQUESTS):
            rng = random.Random(i)
            prompt = [rng.randrange(256) for _ in range(PROMPT)]
            req = GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            seqs.append(s.submit(req))
        await asyncio.wait_for(asyncio.gather(*(q.done for q in seqs)), WAIT_S)
    finally:
        await s.stop()
    assert all(len(q.output) == MAX_TOKENS for q in seqs)
    return s.preemptions, [q.output for q in seqs]


@pytest.mark.timeout(120)
async def test_headroom_stops_preemption_ping_pong() -> None:
    """32 requests on a pool a tenth their size: without headroom a victim is
    readmitted with the blocks it just gave up and preempted again a block later."""
    churn, plain = await _run(0)
    calm, spaced = await _run(64)
    assert calm * 2 <= churn, (calm, churn)
    assert spaced == plain  # greedy tokens do not depend on when recomputes happen
