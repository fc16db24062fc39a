"""Multi-step decode: a decode-only batch runs several steps per engine call, and
nothing a client sees changes (tokens, stops, sampling, usage, cancellation)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest, GenerateResponse
from cachepoint.replica.errors import EngineFailedError
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings

from .conftest import SMALL_LEN


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


class CountingThread(ThreadPoolExecutor):
    """The engine thread, counting the calls the loop hands it."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="engine-test")
        self.calls = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


@contextlib.asynccontextmanager
async def _started(
    engine: Engine, steps: int, budget_s: float = 60.0, **settings: Any
) -> AsyncIterator[tuple[TorchCore, CountingThread]]:
    """A running scheduler with ``decode_steps=steps`` on a counting engine thread.

    NOTE: the default budget is long, so that runs are cut by steps alone however
    slow the machine; the budget test sets its own.
    """
    thread = CountingThread()
    s = ReplicaSettings(name="r-multi", decode_steps=steps, max_num_batched_tokens=256, **settings)
    sched = TorchCore(engine, s, engine_thread=thread)
    sched.multi_step_budget_s = budget_s
    sched.start()
    try:
        yield sched, thread
    finally:
        await sched.stop()
        thread.shutdown()


async def _run(engine: Engine, steps: int, requests: list[dict[str, Any]], **settings: Any):
    async with _started(engine, steps, **settings) as (sched, thread):
        seqs = [sched.submit(GenerateRequest(**r)) for r in requests]
        await asyncio.gather(*(q.done for q in seqs))
        results: list[GenerateResponse] = [sched.result(q) for q in seqs]
        sched.pool.check_invariants()
        assert all(b.ref_cnt == 0 for b in sched.pool.blocks)
        return results, thread.calls, sched.steps, sched.preemptions


def _same(a: list[GenerateResponse], b: list[GenerateResponse]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids
        assert (x.text, x.stop_reason, x.stop_sequence) == (y.text, y.stop_reason, y.stop_sequence)
        assert x.cache == y.cache


async def test_one_request_takes_a_quarter_of_the_engine_calls_and_the_same_tokens(
    engine: Engine,
) -> None:
    req = [{"token_ids": _prompt(60, 1), "max_tokens": 17, "ignore_eos": True}]
    one, calls_one, steps_one, _ = await _run(engine, 1, req)
    four, calls_four, steps_four, _ = await _run(engine, 4, req)
    _same(one, four)
    assert len(four[0].output_token_ids) == 17
    # A prefill step samples the first token; 16 decode steps make the other 16.
    assert steps_one == steps_four == 17
    assert calls_one == 17
    assert calls_four == 1 + 4  # the prefill, then 4 calls of 4 decode steps


@pytest.mark.parametrize("max_tokens", [2, 5, 10])
async def test_max_tokens_that_no_step_count_divides_are_met_exactly(
    engine: Engine, max_tokens: int
) -> None:
    req = [{"token_ids": _prompt(30, 2), "max_tokens": max_tokens, "ignore_eos": True}]
    one, _, _, _ = await _run(engine, 1, req)
    four, _, steps, _ = await _run(engine, 4, req)
    _same(one, four)
    assert len(four[0].output_token_ids) == max_tokens
    assert steps == max_tokens  # never a step past max_tokens


async def test_stops_found_between_calls_end_the_turn_where_one_step_would(
    engine: Engine,
) -> None:
    """A stop string, a stop id and EOS met inside a run of steps: that sequence ends
    where it would have, its extra tokens are dropped, the others go on."""
    prompt = _prompt(40, 3)
    free, _, _, _ = await _run(
        engine, 1, [{"token_ids": prompt, "max_tokens": 30, "ignore_eos": True}]
    )
    text, ids = free[0].text, free[0].output_token_ids
    stop_text = text[9:10]
    stop_id = ids[6]
    requests = [
        {"token_ids": prompt, "max_tokens": 30, "ignore_eos": True, "stop_sequences": [stop_text]},
        {"token_ids": prompt, "max_tokens": 30, "ignore_eos": True, "stop_token_ids": [stop_id]},
        {"token_ids": _prompt(25, 4), "max_tokens": 30},  # EOS when the model says so
        {"token_ids": _prompt(33, 5), "max_tokens": 23, "ignore_eos": True},
    ]
    one, _, _, _ = await _run(engine, 1, requests)
    eight, calls, _, _ = await _run(engine, 8, requests)
    _same(one, eight)
    assert eight[0].stop_reason == "stop_sequence"
    assert eight[1].stop_reason == "stop_sequence" or eight[1].output_token_ids[-1] == stop_id
    assert len(eight[3].output_token_ids) == 23
    assert calls < 23  # several steps per call while all four decode


async def test_seeded_sampling_draws_the_same_tokens(engine: Engine) -> None:
    requests = [
        {
            "token_ids": _prompt(50, 6 + i),
            "max_tokens": 19,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 100 + i,
            "ignore_eos": True,
        }
        for i in range(3)
    ]
    one, _, _, _ = await _run(engine, 1, requests)
    four, _, _, _ = await _run(engine, 4, requests)
    _same(one, four)


async def test_a_request_arriving_mid_run_is_admitted_within_the_run(engine: Engine) -> None:
    async with _started(engine, 16) as (sched, _):
        long = sched.submit(
            GenerateRequest(token_ids=_prompt(40, 7), max_tokens=200, ignore_eos=True)
        )
        while len(long.output) < 20:
            await asyncio.sleep(0.001)
        late = sched.submit(
            GenerateRequest(token_ids=_prompt(20, 8), max_tokens=3, ignore_eos=True)
        )
        await late.done
        # At most one run of 16 steps goes by before the late one's prefill.
        assert len(long.output) <= 20 + 16 + 16 + 3
        assert not long.done.done()
        await long.done
        assert len(sched.result(long).output_token_ids) == 200


async def test_cancel_mid_run_takes_effect_at_the_next_boundary(engine: Engine) -> None:
    async with _started(engine, 8) as (sched, _):
        seq = sched.submit(
            GenerateRequest(token_ids=_prompt(50, 9), max_tokens=400, ignore_eos=True)
        )
        while len(seq.output) < 3:
            await asyncio.sleep(0.001)
        sched.cancel(seq)
        with pytest.raises(Exception, match="disconnected"):
            await seq.done
        assert len(seq.output) < 3 + 2 * 8
        sched.pool.check_invariants()
        assert all(b.ref_cnt == 0 for b in sched.pool.blocks)


async def test_a_pool_too_full_for_the_run_takes_single_steps_and_preempts_as_before(
    small_engine: Engine,
) -> None:
    """Two sequences on a pool of one max_model_len sequence: growth preempts, the
    runs fall back to one step when the blocks for them are not free, and the tokens
    equal single-step scheduling's."""
    requests = [
        {"token_ids": _prompt(90, 10 + i), "max_tokens": SMALL_LEN - 90, "ignore_eos": True}
        for i in range(2)
    ]
    one, _, _, preempted_one = await _run(small_engine, 1, requests, readmit_headroom_tokens=0)
    four, calls, steps, preempted = await _run(small_engine, 4, requests, readmit_headroom_tokens=0)
    _same(one, four)
    assert preempted == preempted_one > 0
    assert steps // 4 < calls < steps  # runs of 4 while blocks allow, single steps not
    assert all(len(r.output_token_ids) == SMALL_LEN - 90 for r in four)


async def test_a_forward_failing_mid_run_fails_the_batch_after_the_steps_before_it(
    engine: Engine,
) -> None:
    """As with one step per call: the batch fails with the engine's error, and the
    tokens the run's earlier steps made were appended (and streamed) first."""
    forwards = {"n": 0}

    def hook(layer: int) -> None:
        if layer == 0:
            forwards["n"] += 1
        if layer == 1 and forwards["n"] == 4:  # prefill, then the run's third decode
            raise RuntimeError("injected fault")

    engine.fault_hook = hook
    try:
        async with _started(engine, 8) as (sched, _):
            seq = sched.submit(
                GenerateRequest(token_ids=_prompt(30, 11), max_tokens=20, ignore_eos=True)
            )
            with pytest.raises(EngineFailedError, match="forward pass failed: injected fault"):
                await seq.done
            assert len(seq.output) == 1 + 2  # the prefill's token, then two decode steps'
            sched.pool.check_invariants()
            assert all(b.ref_cnt == 0 for b in sched.pool.blocks)
    finally:
        engine.fault_hook = None


async def test_a_run_ends_once_its_time_budget_is_spent(engine: Engine) -> None:
    """Slow steps (a large model) are not batched into long runs: a new request never
    waits much longer than the budget for its prefill."""
    # A budget of 0: every step is over it, so one step per call.
    async with _started(engine, 16, budget_s=0.0) as (sched, thread):
        seq = sched.submit(
            GenerateRequest(token_ids=_prompt(30, 12), max_tokens=9, ignore_eos=True)
        )
        await seq.done
        assert len(seq.output) == 9
        assert thread.calls == 9  # the prefill, then one call per decode step
