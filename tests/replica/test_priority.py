"""Priority scheduling and admission without head-of-line blocking."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import ValidationError

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.api.app import create_app
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.sequence import SequenceState
from cachepoint.replica.settings import ReplicaSettings

from .conftest import SMALL_BLOCKS
from .test_preemption import _prompt

WAIT_S = 60
# NOTE: the preemption tests' small engine: one max_model_len (256) sequence of blocks.
BLOCKS = SMALL_BLOCKS


def _req(n: int, seed: int, max_tokens: int, priority: int = 0) -> GenerateRequest:
    return GenerateRequest(
        token_ids=_prompt(n, seed), max_tokens=max_tokens, ignore_eos=True, priority=priority
    )


async def _done(*seqs: SequenceState) -> None:
    await asyncio.wait_for(asyncio.gather(*(asyncio.shield(q.done) for q in seqs)), WAIT_S)


def _assert_clean(s: TorchCore) -> None:
    s.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in s.pool.blocks)
    assert not s.running
    assert not s.waiting


@pytest.mark.parametrize("bad", ["1", 1.5, True, None, 2**31, -(2**31) - 1])
def test_priority_must_be_an_int32(bad: object) -> None:
    with pytest.raises(ValidationError, match="priority"):
        GenerateRequest(token_ids=[1], priority=bad)


def test_priority_defaults_to_zero_and_takes_the_int32_range() -> None:
    assert GenerateRequest(token_ids=[1]).priority == 0
    assert GenerateRequest(token_ids=[1], priority=-(2**31)).priority == -(2**31)
    assert GenerateRequest(token_ids=[1], priority=2**31 - 1).priority == 2**31 - 1


async def test_waiting_queue_orders_by_priority_then_arrival(engine: Engine, sink) -> None:
    s = TorchCore(engine, ReplicaSettings(name="r-prio", max_num_seqs=1), sink=sink)
    a = s.submit(_req(20, 1, 4, priority=0))
    b = s.submit(_req(20, 2, 4, priority=5))
    c = s.submit(_req(20, 3, 4, priority=-1))
    d = s.submit(_req(20, 4, 4, priority=0))
    assert s.waiting == [c, a, d, b]
    s.policy.admit()  # one sequence at a time: the most important goes first
    assert s.running == [c]
    s.start()
    try:
        await _done(a, b, c, d)
    finally:
        await s.stop()
    assert c.t_admit < a.t_admit < d.t_admit < b.t_admit
    _assert_clean(s)


async def test_a_preempted_sequence_requeues_at_its_rank(engine: Engine, sink) -> None:
    s = TorchCore(engine, ReplicaSettings(name="r-rank", max_num_seqs=2), sink=sink)
    old = s.submit(_req(20, 1, 4, priority=1))
    urgent = s.submit(_req(20, 2, 4, priority=0))
    newer = s.submit(_req(20, 3, 4, priority=1))  # same priority as `old`, arrived later
    later = s.submit(_req(20, 4, 4, priority=2))
    s.policy.admit()
    assert s.running == [urgent, old]
    s.policy.preempt(old)
    # Behind the more important, ahead of a newer one at its priority, and of the less.
    assert s.waiting == [old, newer, later]
    s.policy.preempt(urgent)
    assert s.waiting == [urgent, old, newer, later]
    s.start()
    try:
        await _done(old, urgent, newer, later)
    finally:
        await s.stop()
    _assert_clean(s)


async def test_the_lowest_priority_sequence_is_preempted_not_the_newest(
    small_engine: Engine, sink
) -> None:
    """Two that fit alone but not together: the older, less important one gives way."""
    settings = ReplicaSettings(name="r-victim", max_num_batched_tokens=256)
    s = TorchCore(small_engine, settings, sink=sink)
    s.start()
    try:
        alone = []
        for seed in (1, 2):
            q = s.submit(_req(40, seed, 200))
            await _done(q)
            alone.append(q.output)
        s.manager.clear()
        low = s.submit(_req(40, 1, 200, priority=3))  # arrives first
        high = s.submit(_req(40, 2, 200, priority=0))
        await _done(low, high)
    finally:
        await s.stop()
    assert (low.preemptions, high.preemptions) == (1, 0)
    assert s.preemptions == 1
    assert [low.output, high.output] == alone
    _assert_clean(s)


async def test_a_small_request_behind_one_that_does_not_fit_still_runs(
    small_engine: Engine, sink
) -> None:
    settings = ReplicaSettings(name="r-hol", max_num_batched_tokens=256)
    s = TorchCore(small_engine, settings, sink=sink)
    # `running` holds 8 blocks at admission and grows to 12 (100 + 90 tokens); `big`
    # needs 13 for its prompt alone, so it waits for `running` to finish; `small`
    # (2 blocks) fits beside `running` all along.
    running = s.submit(_req(100, 1, 90))
    big = s.submit(_req(200, 2, 8))
    small = s.submit(_req(10, 3, 8))
    s.start()
    try:
        await _done(running, big, small)
    finally:
        await s.stop()
    assert small.t_admit < big.t_admit
    assert small.t_end < big.t_end
    assert running.t_end < big.t_end
    assert [len(q.output) for q in (running, big, small)] == [90, 8, 8]
    assert s.preemptions == 0
    _assert_clean(s)


async def test_a_blocked_request_is_bypassed_a_bounded_number_of_times(
    small_engine: Engine, sink
) -> None:
    settings = ReplicaSettings(name="r-starve", max_num_batched_tokens=256, max_admission_bypass=2)
    s = TorchCore(small_engine, settings, sink=sink)  # admission by hand first
    hog = s.submit(_req(180, 1, 8))  # 187 slots: 12 of the 16 blocks
    big = s.submit(_req(100, 2, 8))  # 7 blocks for its prompt: does not fit beside `hog`
    smalls = [s.submit(_req(10, 10 + i, 2)) for i in range(3)]  # 1 block each
    s.policy.admit()
    # Two went past `big`, then admission stops at it, though the third would fit.
    assert s.running == [hog, *smalls[:2]]
    assert s.waiting == [big, smalls[2]]
    assert big.bypassed == 2
    s.policy.admit()
    assert s.waiting == [big, smalls[2]]
    s.start()
    try:
        await _done(hog, big, *smalls)
    finally:
        await s.stop()
    assert big.t_admit < smalls[2].t_admit  # the starved one went first once it fitted
    assert all(len(q.output) == q.params.max_tokens for q in (hog, big, *smalls))
    _assert_clean(s)


async def test_no_bypass_at_zero_keeps_strict_queue_order(small_engine: Engine, sink) -> None:
    settings = ReplicaSettings(name="r-fifo", max_num_batched_tokens=256, max_admission_bypass=0)
    s = TorchCore(small_engine, settings, sink=sink)
    hog = s.submit(_req(180, 1, 8))
    big = s.submit(_req(100, 2, 8))
    small = s.submit(_req(10, 3, 2))
    s.policy.admit()
    assert s.running == [hog]
    assert s.waiting == [big, small]
    s.start()
    try:
        await _done(hog, big, small)
    finally:
        await s.stop()
    _assert_clean(s)


def test_a_bad_priority_is_a_clear_400_naming_the_field(engine: Engine, sink, serve) -> None:
    url = serve(create_app(ReplicaSettings(name="r-422"), engine, sink=sink))
    for bad in ("high", 2.5, 2**40):
        r = httpx.post(f"{url}/v1/generate", json={"token_ids": [1, 2], "priority": bad})
        # NOTE: the replica answers every validation error with a 400 invalid_request_error.
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("priority: Input should be")
    ok = httpx.post(
        f"{url}/v1/generate", json={"token_ids": [1, 2], "max_tokens": 2, "priority": -3}
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["timings"]["preemptions"] == 0
