"""Decode steps and whole generations, from scratch and from a cached prefix."""

from __future__ import annotations

import pytest

from cachepoint.engine import (
    BlockAllocator,
    DecodeRequest,
    Engine,
    GenerationRequest,
    PrefillRequest,
    SamplingParams,
)

from .helpers import TOL, blocks_for, max_rel_err, random_prompt


def test_decode_matches_prefill_of_the_longer_prompt(engine: Engine, alloc: BlockAllocator) -> None:
    prompt = random_prompt(21, 48, engine.vocab_size)
    table = blocks_for(engine, alloc, 49)
    engine.prefill([PrefillRequest(prompt[:47], table, 0)])
    stepped = engine.decode([DecodeRequest(prompt[47], 47, table)])
    ref = engine.prefill([PrefillRequest(prompt, blocks_for(engine, alloc, 48), 0)])
    assert max_rel_err(stepped, ref.prefill_logits) <= TOL


def test_decode_batch_of_different_positions_matches_single_decodes(
    engine: Engine, alloc: BlockAllocator
) -> None:
    lengths = [3, 16, 17, 70]
    reqs = []
    for i, n in enumerate(lengths):
        prompt = random_prompt(30 + i, n, engine.vocab_size)
        table = blocks_for(engine, alloc, n + 1)
        engine.prefill([PrefillRequest(prompt, table, 0)])
        reqs.append(DecodeRequest(prompt[-1], n, table))
    together = engine.decode(reqs)
    for i, req in enumerate(reqs):
        assert max_rel_err(together[i], engine.decode([req])[0]) <= TOL


@pytest.mark.parametrize(("n", "m"), [(40, 16), (40, 23), (33, 32), (64, 1)])
def test_generate_greedy_from_cached_prefix_equals_from_scratch(
    engine: Engine, alloc: BlockAllocator, n: int, m: int
) -> None:
    prompt = random_prompt(n * 100 + m, n, engine.vocab_size)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    scratch = engine.generate([GenerationRequest(prompt, params)], alloc)[0]

    table = blocks_for(engine, alloc, m)
    engine.prefill([PrefillRequest(prompt[:m], table, 0)])
    cached = engine.generate([GenerationRequest(prompt, params, table, m)], alloc)[0]

    assert cached.token_ids == scratch.token_ids
    assert len(cached.token_ids) == 40
    assert cached.finish_reason == "length"
    assert cached.num_kv_tokens == n + 39
    assert len(cached.block_table) * engine.block_size >= cached.num_kv_tokens


def test_generate_batch_equals_one_at_a_time(engine: Engine, alloc: BlockAllocator) -> None:
    prompts = [random_prompt(40 + i, n, engine.vocab_size) for i, n in enumerate((5, 31, 64))]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.2, top_k=20, seed=6, ignore_eos=True),
    ]
    reqs = [GenerationRequest(p, s) for p, s in zip(prompts, params, strict=True)]
    together = engine.generate(reqs, alloc)
    for req, got in zip(reqs, together, strict=True):
        alone = engine.generate([GenerationRequest(req.prompt_ids, req.params)], alloc)[0]
        assert got.token_ids == alone.token_ids
        assert len(got.token_ids) == req.params.max_tokens


def test_generate_stops_at_eos(
    engine: Engine, alloc: BlockAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = random_prompt(50, 20, engine.vocab_size)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    free_run = engine.generate([GenerationRequest(prompt, params)], alloc)[0].token_ids
    # Declare the fifth greedy token the EOS: generation must end at its first use.
    eos = free_run[4]
    monkeypatch.setattr(Engine, "eos_id", property(lambda self: eos))
    stopped = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=30))], alloc)
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == free_run[: free_run.index(eos) + 1]
    by_id = SamplingParams(max_tokens=30, stop_token_ids=(eos,), ignore_eos=True)
    assert engine.generate([GenerationRequest(prompt, by_id)], alloc)[0].token_ids == (
        stopped[0].token_ids
    )


def test_generate_stops_at_a_stop_string(engine: Engine, alloc: BlockAllocator) -> None:
    prompt = random_prompt(51, 20, engine.vocab_size)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    free_run = engine.generate([GenerationRequest(prompt, params)], alloc)[0].token_ids
    # An ASCII byte decodes to itself wherever it sits, so it makes an exact stop string.
    at = next(i for i, t in enumerate(free_run) if i > 0 and 32 <= t < 127)
    stop = chr(free_run[at])
    text = engine.tokenizer.decode(free_run)
    with_stop = SamplingParams(max_tokens=40, stop=("never", stop), ignore_eos=True)
    got = engine.generate([GenerationRequest(prompt, with_stop)], alloc)[0]
    assert got.finish_reason == "stop"
    assert got.stop_sequence == stop
    assert got.token_ids == free_run[: free_run.index(free_run[at]) + 1]
    assert got.text == text[: text.find(stop)]


def test_generate_seeded_sampling_is_deterministic(engine: Engine, alloc: BlockAllocator) -> None:
    prompt = random_prompt(60, 25, engine.vocab_size)
    params = SamplingParams(max_tokens=25, temperature=1.0, seed=99, ignore_eos=True)
    a = engine.generate([GenerationRequest(prompt, params)], alloc)[0]
    b = engine.generate([GenerationRequest(prompt, params)], alloc)[0]
    other = SamplingParams(max_tokens=25, temperature=1.0, seed=100, ignore_eos=True)
    c = engine.generate([GenerationRequest(prompt, other)], alloc)[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_decode_rejects_a_position_beyond_the_block_table(engine: Engine) -> None:
    with pytest.raises(ValueError, match="block table"):
        engine.decode([DecodeRequest(1, 16, [0])])
    with pytest.raises(ValueError, match="position"):
        engine.decode([DecodeRequest(1, engine.max_model_len, list(range(engine.num_blocks)))])
