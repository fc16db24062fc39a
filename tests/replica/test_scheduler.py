"""The scheduler with the real tiny engine on the CPU."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from cachepoint.engine import Engine
from cachepoint.kvcore import BlockStored
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.errors import (
    EngineFailedError,
    InvalidRequestError,
    QueueFullError,
)
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.request_state import SeqStatus


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def _generate(sched: TorchCore, **kw):
    seq = sched.submit(GenerateRequest(**kw))
    await seq.done
    return sched.result(seq)


def _assert_clean(sched: TorchCore) -> None:
    sched.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in sched.pool.blocks)
    assert not sched.running
    assert not sched.waiting


@pytest.fixture
async def sched(engine: Engine, settings, sink):
    s = TorchCore(engine, settings, sink=sink)
    s.start()
    yield s
    await s.stop()
    engine.fault_hook = None


async def test_scheduler_cached_generation_equals_uncached(sched: TorchCore):
    prompt = _prompt(100, 1)
    cold = await _generate(sched, token_ids=prompt, max_tokens=12, ignore_eos=True)
    warm = await _generate(sched, token_ids=prompt, max_tokens=12, ignore_eos=True)
    assert cold.cache.engine_hit_tokens == 0
    assert warm.cache.engine_hit_tokens == 96
    assert warm.cache.computed_tokens == 4
    assert warm.output_token_ids == cold.output_token_ids
    _assert_clean(sched)


async def test_scheduler_batches_concurrent_requests(sched: TorchCore):
    prompts = [_prompt(40 + 7 * i, 10 + i) for i in range(5)]
    alone = [
        (await _generate(sched, token_ids=p, max_tokens=8, ignore_eos=True)).output_token_ids
        for p in prompts
    ]
    sched.manager.clear()  # make the batched run compute everything again
    steps_before = sched.steps
    results = await asyncio.gather(
        *[_generate(sched, token_ids=p, max_tokens=8, ignore_eos=True) for p in prompts]
    )
    assert [r.output_token_ids for r in results] == alone
    # 5 sequences x (1 prefill + 7 decodes) alone would be 40 steps; batched far fewer.
    assert sched.steps - steps_before <= 12
    _assert_clean(sched)


async def test_scheduler_long_prefill_does_not_stall_decodes(sched: TorchCore):
    # Budget 256 tokens per step: a 1,500-token prompt needs 6 prefill chunks.
    short = sched.submit(GenerateRequest(token_ids=_prompt(20, 3), max_tokens=4, ignore_eos=True))
    await asyncio.sleep(0)
    long = sched.submit(GenerateRequest(token_ids=_prompt(1500, 4), max_tokens=2, ignore_eos=True))
    await short.done
    assert long.status is not SeqStatus.FINISHED
    assert long.num_computed < long.prompt_len  # still prefilling when short finished
    await long.done
    _assert_clean(sched)


async def test_scheduler_managed_entries_and_report(sched: TorchCore):
    prompt = _prompt(64, 5)
    first = await _generate(
        sched, token_ids=prompt, max_tokens=2, breakpoints=[{"position": 40, "ttl": "1h"}]
    )
    assert (first.cache.written_1h_tokens, first.cache.written_5m_tokens) == (40, 0)
    longer = [*prompt, *_prompt(30, 6)]
    second = await _generate(
        sched,
        token_ids=longer,
        max_tokens=2,
        breakpoints=[{"position": 40, "ttl": "1h"}, {"position": 90}],
    )
    c = second.cache
    assert c.entry_hit_tokens == 40
    assert (c.written_1h_tokens, c.written_5m_tokens) == (0, 50)
    # All 4 full blocks of the first prompt were published; only 40 tokens were marked.
    assert c.engine_hit_tokens == 64
    assert sched.cache_stats().entries == 2


async def test_scheduler_rejects_bad_input(sched: TorchCore):
    with pytest.raises(InvalidRequestError, match=r"token_ids\.1"):
        sched.submit(GenerateRequest(token_ids=[1, 10_000]))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.submit(GenerateRequest(token_ids=[1] * 2048))
    with pytest.raises(ValueError, match="past the prompt"):
        GenerateRequest(token_ids=[1, 2], breakpoints=[{"position": 3}])


async def test_scheduler_queue_bound_gives_queue_full(engine: Engine, settings, sink):
    s = TorchCore(engine, settings, sink=sink)  # not started: nothing drains the queue
    for _ in range(settings.max_waiting):
        s.submit(GenerateRequest(token_ids=[1, 2, 3]))
    with pytest.raises(QueueFullError, match="waiting"):
        s.submit(GenerateRequest(token_ids=[1, 2, 3]))
    await s.stop()
    _assert_clean(s)


@pytest.mark.parametrize("seed", range(6))
async def test_scheduler_fault_in_forward_aborts_cleanly(sched: TorchCore, engine, sink, seed):
    """Raise inside the forward pass at a random layer, during prefill or decode."""
    rng = random.Random(seed)
    prompt = _prompt(rng.randrange(40, 200), 100 + seed)
    during_decode = seed % 2 == 1
    fail_layer = rng.randrange(engine.model_config.num_layers)
    calls = {"forwards": 0}

    def hook(layer: int) -> None:
        if layer == 0:
            calls["forwards"] += 1
        # Prefill is forward 1; decode forwards follow.
        if layer == fail_layer and calls["forwards"] == (3 if during_decode else 1):
            raise RuntimeError(f"injected fault at layer {layer}")

    # A warm prefix, so the failing request also holds hit blocks.
    await _generate(sched, token_ids=prompt[:33], max_tokens=1)
    stats_before = sched.cache_stats()
    events_before = len(sink.events)
    engine.fault_hook = hook
    with pytest.raises(EngineFailedError, match="injected fault"):
        await _generate(sched, token_ids=prompt, max_tokens=5, ignore_eos=True)
    engine.fault_hook = None
    _assert_clean(sched)
    stored_after = [e for e in sink.events[events_before:] if isinstance(e, BlockStored)]
    if during_decode:
        # The prefill succeeded, so its blocks were published before the failure.
        assert stored_after
    else:
        assert stored_after == []
        assert sched.cache_stats().blocks.cached_free == stats_before.blocks.cached_free
    # The next identical request recomputes correctly.
    again = await _generate(sched, token_ids=prompt, max_tokens=5, ignore_eos=True)
    sched.manager.clear()
    fresh = await _generate(sched, token_ids=prompt, max_tokens=5, ignore_eos=True)
    assert again.output_token_ids == fresh.output_token_ids
    _assert_clean(sched)


async def test_scheduler_cancel_mid_decode_returns_blocks(sched: TorchCore):
    seq = sched.submit(GenerateRequest(token_ids=_prompt(50, 8), max_tokens=400, ignore_eos=True))
    while len(seq.output) < 3:
        await asyncio.sleep(0.001)
    sched.cancel(seq)
    with pytest.raises(Exception, match="disconnected"):
        await seq.done
    _assert_clean(sched)


async def test_scheduler_stop_sequence_and_eos(sched: TorchCore, engine: Engine):
    prompt = _prompt(30, 9)
    free = await _generate(sched, token_ids=prompt, max_tokens=30, ignore_eos=True)
    text = free.text
    assert text
    stop = text[len(text) // 2 : len(text) // 2 + 1]
    stopped = await _generate(
        sched, token_ids=prompt, max_tokens=30, ignore_eos=True, stop_sequences=[stop]
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    assert stop not in stopped.text
    assert free.stop_reason == "max_tokens"


def _new_token_at(tokens: list[int], at: int) -> tuple[int, int]:
    """(index, token) of the first token from ``at`` on that did not come before it."""
    i = next(i for i in range(at, len(tokens)) if tokens[i] not in tokens[:i])
    return i, tokens[i]


async def test_scheduler_any_eos_id_of_the_checkpoint_ends_the_turn(engine: Engine, settings, sink):
    prompt = _prompt(30, 11)
    cfg = engine.model_config
    free = await _free_run(engine, settings, sink, prompt)
    at, second = _new_token_at(free, 4)
    assert engine.eos_id not in free[: at + 1]
    # The same weights (same shape and seed), with a second EOS id in the config.
    two = Engine(replace(cfg, eos_token_ids=(engine.eos_id, second)), engine.config, seed=1)
    assert two.eos_ids == {engine.eos_id, second}
    s = TorchCore(two, settings, sink=sink)
    s.start()
    try:
        got = await _generate(s, token_ids=prompt, max_tokens=20)
        assert got.stop_reason == "end_turn"
        assert got.output_token_ids == free[: at + 1]
        kept = await _generate(s, token_ids=prompt, max_tokens=20, ignore_eos=True)
        assert kept.stop_reason == "max_tokens"
        assert kept.output_token_ids == free
    finally:
        await s.stop()


async def _free_run(engine: Engine, settings, sink, prompt: list[int]) -> list[int]:
    s = TorchCore(engine, settings, sink=sink)
    s.start()
    try:
        res = await _generate(s, token_ids=prompt, max_tokens=20, ignore_eos=True)
    finally:
        await s.stop()
    assert res.stop_reason == "max_tokens"
    return list(res.output_token_ids)


async def test_scheduler_request_stop_token_ids_end_the_turn(sched: TorchCore):
    prompt = _prompt(30, 12)
    free = await _generate(sched, token_ids=prompt, max_tokens=20, ignore_eos=True)
    at, stop_id = _new_token_at(list(free.output_token_ids), 3)
    # NOTE: a request's stop ids end the turn even with ignore_eos (which is about EOS).
    got = await _generate(
        sched, token_ids=prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]
    )
    assert got.stop_reason == "end_turn"
    assert got.output_token_ids == free.output_token_ids[: at + 1]
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids\.1: 99999 is not a token id"):
        sched.submit(GenerateRequest(token_ids=prompt, stop_token_ids=[stop_id, 99999]))
    _assert_clean(sched)


async def test_a_finished_turns_answer_is_reused_by_the_next_turn(sched: TorchCore):
    """An agent's next prompt repeats the last prompt and its answer: the answer's full
    blocks were published when the turn ended, so they are hits (billed as input: no
    entry covers them), not recomputed. A cancelled turn publishes nothing more."""
    prompt = _prompt(100, 7)
    first = await _generate(sched, token_ids=prompt, max_tokens=40, ignore_eos=True)
    answer = first.output_token_ids
    assert len(answer) == 40
    block = sched.block_size
    nxt = prompt + answer + _prompt(20, 8)
    second = await _generate(sched, token_ids=nxt, max_tokens=2, ignore_eos=True)
    # KV exists for the prompt and every answer token but the last (never fed)
    assert second.cache.engine_hit_tokens == (len(prompt) + len(answer) - 1) // block * block
    assert second.cache.engine_hit_tokens > len(prompt) // block * block
    assert (second.cache.written_5m_tokens, second.cache.written_1h_tokens) == (0, 0)
    _assert_clean(sched)


async def test_requests_sent_together_with_one_prefix_compute_it_once(sched: TorchCore):
    """The first-turn herd on the real engine: the prefix is computed once, and the
    others wait for it and hit its blocks."""
    herd_prompt = _prompt(100, 12)
    seqs = [
        sched.submit(GenerateRequest(token_ids=[*herd_prompt, i], max_tokens=6, ignore_eos=True))
        for i in range(3)
    ]
    await asyncio.gather(*(s.done for s in seqs))
    results = [sched.result(s) for s in seqs]
    assert sorted(r.cache.engine_hit_tokens for r in results) == [0, 96, 96]
    assert sum(r.cache.computed_tokens for r in results) == 101 + 5 + 5
    _assert_clean(sched)
