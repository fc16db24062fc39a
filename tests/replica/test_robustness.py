"""One request must never kill a replica.

Each test bounds its waits: on the code before the fix the scheduler loop died and
every request hung, so an unbounded await would hang the suite instead of failing.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cachepoint.engine import ByteTokenizer, Engine, StopChecker
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.errors import (
    OverloadedError,
    ReplicaFailedError,
    RequestFailedError,
)
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.request_state import SeqStatus
from cachepoint.replica.sequence import SequenceState
from cachepoint.replica.step import StepPlan

WAIT_S = 30


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _assert_clean(sched: TorchCore) -> None:
    sched.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in sched.pool.blocks)
    assert not sched.running
    assert not sched.waiting


async def _done(seq: SequenceState) -> None:
    await asyncio.wait_for(asyncio.shield(seq.done), WAIT_S)


@pytest.fixture
async def sched(engine: Engine, settings, sink):
    s = TorchCore(engine, settings, sink=sink)
    s.start()
    yield s
    await s.stop()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-300},
        {"temperature": 1.0, "top_p": 1e-50},
        {"temperature": 5e-324, "top_p": 5e-324, "top_k": 3},
    ],
)
async def test_extreme_sampling_values_neither_kill_the_loop_nor_fail(sched: TorchCore, params):
    """The reproduction: these pass validation, and used to raise inside
    sample() outside the loop's try, killing the loop and hanging every request."""
    prompt = _prompt(60, 1)
    greedy = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=6, ignore_eos=True))
    extreme = sched.submit(
        GenerateRequest(token_ids=prompt, max_tokens=6, ignore_eos=True, seed=4, **params)
    )
    await _done(greedy)
    await _done(extreme)
    # Each of these settings is greedy in all but name: the same tokens as greedy.
    assert sched.result(extreme).output_token_ids == sched.result(greedy).output_token_ids
    assert sched.alive
    _assert_clean(sched)


async def test_a_row_whose_sampling_raises_fails_alone(sched: TorchCore):
    prompt = _prompt(80, 2)
    alone = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=8, ignore_eos=True))
    await _done(alone)
    expected = sched.result(alone).output_token_ids

    left = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=8, ignore_eos=True))
    bad = sched.submit(
        GenerateRequest(token_ids=_prompt(70, 3), max_tokens=8, temperature=1.0, seed=1)
    )
    right = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=8, ignore_eos=True))
    bad.generator = object()  # type: ignore[assignment]  # torch.multinomial raises for it
    for seq in (left, bad, right):
        await asyncio.wait_for(asyncio.wait({seq.done}), WAIT_S)
    with pytest.raises(RequestFailedError, match="TypeError") as err:
        bad.done.result()
    assert err.value.kind == "api_error" and err.value.status == 500
    # Its batch neighbours were not touched, and the loop goes on.
    assert sched.result(left).output_token_ids == expected
    assert sched.result(right).output_token_ids == expected
    assert sched.alive
    again = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=8, ignore_eos=True))
    await _done(again)
    assert sched.result(again).output_token_ids == expected
    _assert_clean(sched)


class _ExplodingStopper(StopChecker):
    """Decoding this request's text raises (as a broken tokenizer would)."""

    def append(self, token_id: int) -> str | None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decode failure")


async def test_a_request_whose_stop_check_raises_fails_alone(sched: TorchCore):
    prompt = _prompt(50, 4)
    good = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=5, ignore_eos=True))
    bad = sched.submit(GenerateRequest(token_ids=prompt, max_tokens=5, ignore_eos=True))
    bad.stopper = _ExplodingStopper(ByteTokenizer(), ())
    await _done(good)
    await asyncio.wait_for(asyncio.wait({bad.done}), WAIT_S)
    with pytest.raises(RequestFailedError, match="injected decode failure"):
        bad.done.result()
    assert sched.result(good).output_tokens == 5
    assert sched.alive
    _assert_clean(sched)


async def test_a_request_whose_commit_raises_fails_alone(
    sched: TorchCore, monkeypatch: pytest.MonkeyPatch
):
    commit = sched._commit_prefill

    def flaky(seq: SequenceState) -> None:
        if seq.request_id == "bad":
            raise RuntimeError("injected commit failure")
        commit(seq)

    monkeypatch.setattr(sched, "_commit_prefill", flaky)
    good = sched.submit(GenerateRequest(token_ids=_prompt(40, 5), max_tokens=4, ignore_eos=True))
    bad = sched.submit(
        GenerateRequest(token_ids=_prompt(40, 6), max_tokens=4, request_id="bad", ignore_eos=True)
    )
    await _done(good)
    await asyncio.wait_for(asyncio.wait({bad.done}), WAIT_S)
    with pytest.raises(RequestFailedError, match="injected commit failure"):
        bad.done.result()
    assert bad.status is SeqStatus.FINISHED
    assert sched.result(good).output_tokens == 4
    assert sched.alive
    _assert_clean(sched)


async def test_a_failing_finish_hook_fails_nothing(sched: TorchCore):
    def broken(seq: SequenceState) -> None:
        raise RuntimeError("metrics exploded")

    sched.on_finish = broken
    for i in range(2):
        seq = sched.submit(GenerateRequest(token_ids=_prompt(30, 10 + i), max_tokens=3))
        await _done(seq)
        assert sched.result(seq).output_tokens >= 1
    assert sched.alive


async def test_a_dead_loop_fails_every_request_and_refuses_new_ones(sched: TorchCore):
    deaths: list[BaseException] = []
    sched.on_death = deaths.append
    running = sched.submit(
        GenerateRequest(token_ids=_prompt(60, 7), max_tokens=500, ignore_eos=True)
    )
    await asyncio.wait_for(running.stream.get(), WAIT_S)  # its prefill committed

    def die(batch: StepPlan) -> None:
        raise RuntimeError("injected loop fault")

    sched.fault_hook = die
    waiting = sched.submit(GenerateRequest(token_ids=_prompt(40, 8), max_tokens=3))
    for seq in (running, waiting):
        await asyncio.wait_for(asyncio.wait({seq.done}), WAIT_S)
        with pytest.raises(ReplicaFailedError, match="scheduler loop stopped"):
            seq.done.result()
    assert not sched.alive
    assert isinstance(sched.failure, RuntimeError)
    assert [str(e) for e in deaths] == ["injected loop fault"]
    with pytest.raises(OverloadedError, match="scheduler loop stopped"):
        sched.submit(GenerateRequest(token_ids=[1, 2, 3]))
    _assert_clean(sched)
