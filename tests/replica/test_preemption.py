"""Grow-on-demand admission and recompute preemption, with the real tiny engine."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from prometheus_client import generate_latest

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest, GenerateResponse
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.metrics import ReplicaMetrics
from cachepoint.replica.sequence import PrefillDone, SequenceState, TokenEvent
from cachepoint.replica.settings import ReplicaSettings


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def _drain(seq: SequenceState) -> list[TokenEvent | PrefillDone]:
    events: list[TokenEvent | PrefillDone] = []
    while (ev := await seq.stream.get()) is not None:
        events.append(ev)
    return events


async def _run(sched: TorchCore, **kw) -> tuple[GenerateResponse, list[TokenEvent | PrefillDone]]:
    seq = sched.submit(GenerateRequest(**kw))
    events = await _drain(seq)
    await seq.done
    return sched.result(seq), events


def _check_stream(res: GenerateResponse, events: list[TokenEvent | PrefillDone]) -> None:
    """One prefill_done, first, carrying the final report; each token exactly once."""
    assert isinstance(events[0], PrefillDone)
    assert events[0].cache == res.cache
    tokens = events[1:]
    assert all(isinstance(e, TokenEvent) for e in tokens)
    assert [e.token_id for e in tokens] == res.output_token_ids  # type: ignore[union-attr]
    assert "".join(e.text for e in tokens) == res.text  # type: ignore[union-attr]
    assert res.output_tokens == len(tokens)


def _assert_clean(sched: TorchCore) -> None:
    sched.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in sched.pool.blocks)
    assert not sched.running
    assert not sched.waiting


async def test_max_tokens_32000_reserves_prompt_plus_headroom(engine: Engine, settings, sink):
    # The shared engine: 256 blocks, max_model_len 2048 (128 blocks). Reserving
    # prompt + max_tokens would admit two of these; grow-on-demand admits all three.
    s = TorchCore(engine, settings, sink=sink)  # not started: admission alone
    seqs = [
        s.submit(GenerateRequest(token_ids=_prompt(30, i), max_tokens=32000, ignore_eos=True))
        for i in range(3)
    ]
    s.policy.admit()
    assert s.running == seqs
    headroom = settings.decode_reserve_blocks * engine.block_size
    assert [len(q.alloc.blocks) for q in seqs] == [math.ceil((30 + headroom) / 16)] * 3
    s.start()
    try:
        while min(len(q.output) for q in seqs) < 20:
            await asyncio.sleep(0.001)
        # All three decode together, each holding only what it has used (+ one ahead).
        assert all(q in s.running for q in seqs)
        assert all(len(q.alloc.blocks) * 16 <= 30 + len(q.output) + 1 + 16 for q in seqs)
    finally:
        for q in seqs:
            s.cancel(q)
        await s.stop()
    assert s.preemptions == 0
    _assert_clean(s)


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"]
)
async def test_preempted_sequence_resumes_with_the_same_tokens(
    small_engine: Engine, sink, sampling: dict[str, object]
):
    # NOTE: seeded sampling too: the recompute samples once, as the decode it replaces
    # would have, so the sequence's generator stays in step.
    settings = ReplicaSettings(name="r-pre", max_num_batched_tokens=256)
    s = TorchCore(small_engine, settings, sink=sink)
    metrics = ReplicaMetrics(s)
    s.start()
    try:
        a_prompt, b_prompt = _prompt(40, 1), _prompt(40, 2)
        kw = {"max_tokens": 200, "ignore_eos": True, **sampling}
        # Alone each fits (239 slots = 15 of 16 blocks); together they need 30.
        alone_a, _ = await _run(s, token_ids=a_prompt, **kw)
        alone_b, _ = await _run(s, token_ids=b_prompt, **kw)
        assert s.preemptions == 0
        s.manager.clear()  # both prompts computed again: a report with no hit
        a = s.submit(GenerateRequest(token_ids=a_prompt, **kw))
        b = s.submit(GenerateRequest(token_ids=b_prompt, **kw))
        ev_a, ev_b = await asyncio.gather(_drain(a), _drain(b))
        await asyncio.gather(a.done, b.done)
        res_a, res_b = s.result(a), s.result(b)
    finally:
        await s.stop()
    # The newest (b) was preempted, once; the oldest ran through.
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert s.preemptions == 1
    assert res_a.output_token_ids == alone_a.output_token_ids
    assert res_b.output_token_ids == alone_b.output_token_ids
    for res, ev in ((res_a, ev_a), (res_b, ev_b)):
        _check_stream(res, ev)
        assert res.output_tokens == 200
        assert res.stop_reason == "max_tokens"
        # Billed once, as first admitted: the whole prompt computed, nothing hit.
        assert res.cache.prompt_tokens == 40
        assert (res.cache.engine_hit_tokens, res.cache.computed_tokens) == (0, 40)
    text = generate_latest(metrics.registry).decode()
    assert 'cachepoint_replica_preemptions_total{replica="r-pre"} 1.0' in text
    _assert_clean(s)


async def test_lone_sequence_the_pool_cannot_grow_ends_with_max_tokens(small_engine: Engine, sink):
    # Half the pool may be retained, all of it by one tenant: a 1h entry over a
    # 128-token prompt parks 8 of the 16 blocks, out of everyone's reach.
    settings = ReplicaSettings(
        name="r-full", max_num_batched_tokens=256, retained_share=0.5, org_retained_share=1.0
    )
    s = TorchCore(small_engine, settings, sink=sink)
    s.start()
    try:
        held, _ = await _run(
            s,
            token_ids=_prompt(128, 3),
            max_tokens=1,
            breakpoints=[{"position": 128, "ttl": "1h"}],
        )
        assert held.cache.written_1h_tokens == 128
        assert s.cache_stats().blocks.retained == 8
        # 20 + 236 tokens would need all 16 blocks; 8 are left (128 slots). The last
        # decode writes slot 127, so it generates 128 - 20 + 1 tokens, then stops.
        res, events = await _run(s, token_ids=_prompt(20, 4), max_tokens=236, ignore_eos=True)
    finally:
        await s.stop()
    assert res.stop_reason == "max_tokens"
    assert res.output_tokens == 8 * 16 - 20 + 1
    _check_stream(res, events)
    assert s.preemptions == 0
    s.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in s.pool.blocks)


async def test_preempted_before_commit_starts_over(small_engine: Engine, sink):
    """A sequence preempted while still prefilling reports as if admitted once."""
    settings = ReplicaSettings(name="r-early", max_num_batched_tokens=256)
    s = TorchCore(small_engine, settings, sink=sink)  # driven by hand, step by step
    a = s.submit(GenerateRequest(token_ids=_prompt(40, 5), max_tokens=4, ignore_eos=True))
    b = s.submit(GenerateRequest(token_ids=_prompt(40, 6), max_tokens=4, ignore_eos=True))
    s.policy.admit()
    assert s.running == [a, b]
    s.policy.preempt(b)
    assert s.waiting[0] is b and b.alloc is None and b.plan is None
    s.start()
    try:
        await asyncio.gather(a.done, b.done)
        events = await _drain(b)
    finally:
        await s.stop()
    res = s.result(b)
    _check_stream(res, events)
    assert res.output_tokens == 4
    assert (res.cache.engine_hit_tokens, res.cache.computed_tokens) == (0, 40)
    _assert_clean(s)
