"""A preempted sequence is not readmitted into a pool that would preempt it again at
once: each recompute costs its whole context, so ping-pong must not happen."""

from __future__ import annotations

import asyncio
import random

import pytest

from cachepoint.protocol import GenerateRequest
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings

from .test_preemption_load import MAX_TOKENS, POOL_BLOCKS, PROMPT, REQUESTS, WAIT_S, _engine


async def _run(headroom: int) -> tuple[int, list[list[int]]]:
    settings = ReplicaSettings(
        name="r-headroom", max_num_batched_tokens=256, readmit_headroom_tokens=headroom
    )
    s = TorchCore(_engine(POOL_BLOCKS), settings)
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


@pytest.mark.timeout(60)
async def test_waiting_request_that_cannot_fit_is_not_allocated_every_step() -> None:
    """While a request cannot possibly fit, admission does not plan, allocate and abort
    it again at every step (host work that grew with every waiting request)."""
    s = TorchCore(_engine(20), ReplicaSettings(name="r-fit", max_num_batched_tokens=256))
    attempts: list[int] = []
    real = s.policy._allocate

    def spy(cp, n, slots):  # type: ignore[no-untyped-def]
        attempts.append(slots)
        return real(cp, n, slots)

    s.policy._allocate = spy  # type: ignore[method-assign]
    s.start()
    try:
        # The runner grows to 15 of the 20 blocks; the big one needs 14: it must wait.
        runner = s.submit(GenerateRequest(token_ids=[7] * 32, max_tokens=200, ignore_eos=True))
        while len(runner.output) < 150:  # 182 tokens: 12 blocks held, 8 free
            await asyncio.sleep(0.005)
        steps_before = s.steps
        big = s.submit(GenerateRequest(token_ids=[9] * 200, max_tokens=8, ignore_eos=True))
        await asyncio.wait_for(asyncio.gather(runner.done, big.done), WAIT_S)
    finally:
        await s.stop()
    assert len(big.output) == 8 and len(runner.output) == 200
    big_attempts = [a for a in attempts if a >= 200]
    assert s.steps - steps_before > 30
    assert len(big_attempts) <= 3, (len(big_attempts), s.steps - steps_before)
