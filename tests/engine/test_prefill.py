"""Core acceptance: prefill with reuse equals prefill from scratch (logits and K/V)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cachepoint.engine import BlockAllocator, DecodeRequest, Engine, PrefillRequest, attention

from .helpers import TOL, blocks_for, max_rel_err, random_prompt


def assert_same_kv(engine: Engine, table_a: list[int], table_b: list[int], n: int) -> None:
    for layer in range(engine.model_config.num_layers):
        ka, va = engine.runner.pool.read_positions(layer, table_a, n)
        kb, vb = engine.runner.pool.read_positions(layer, table_b, n)
        assert max_rel_err(kb, ka) <= TOL, f"K differs in layer {layer}"
        assert max_rel_err(vb, va) <= TOL, f"V differs in layer {layer}"


@settings(max_examples=40, deadline=None)
@given(
    block_size=st.sampled_from([4, 16]),
    n=st.integers(min_value=2, max_value=160),
    split=st.data(),
    seed=st.integers(min_value=0, max_value=2**31),
)
@example(block_size=16, n=64, split=None, seed=1)  # M on a boundary, N a multiple of B
@example(block_size=16, n=50, split=None, seed=2)  # N not a multiple of B
@example(block_size=4, n=2, split=None, seed=3)  # the shortest prompt: M = 1
def test_prefill_with_reuse_matches_full_prefill(
    engine: Engine,
    engine_b4: Engine,
    block_size: int,
    n: int,
    split: st.DataObject | None,
    seed: int,
) -> None:
    eng = engine if block_size == 16 else engine_b4
    if split is None:
        # The explicit examples: cache up to the last block boundary before the end.
        m = max(1, (n - 1) // block_size * block_size)
    else:
        boundaries = [k * block_size for k in range(1, (n - 1) // block_size + 1)]
        anywhere = st.integers(min_value=1, max_value=n - 1)
        m = split.draw(st.sampled_from(boundaries) | anywhere if boundaries else anywhere)
    alloc = BlockAllocator(eng.num_blocks)
    prompt = random_prompt(seed, n, eng.vocab_size)

    full_table = blocks_for(eng, alloc, n)
    full = eng.prefill([PrefillRequest(prompt, full_table, 0)]).prefill_logits

    table = blocks_for(eng, alloc, n)
    eng.prefill([PrefillRequest(prompt[:m], table, 0)])
    cached = eng.prefill([PrefillRequest(prompt, table, m)]).prefill_logits

    assert max_rel_err(cached, full) <= TOL
    assert_same_kv(eng, full_table, table, n)


def test_prefill_shared_prefix_blocks_are_only_read(engine: Engine, alloc: BlockAllocator) -> None:
    """A second sequence reusing the first one's full blocks never writes into them."""
    prompt = random_prompt(7, 100, engine.vocab_size)
    first = blocks_for(engine, alloc, 100)
    engine.prefill([PrefillRequest(prompt, first, 0)])
    before = [engine.runner.pool.read_positions(layer, first, 100) for layer in range(2)]

    other = [*prompt[:64], *random_prompt(8, 40, engine.vocab_size)]
    shared = first[:4] + alloc(3)  # 64 tokens = 4 full blocks
    reused = engine.prefill([PrefillRequest(other, shared, 64)]).prefill_logits
    scratch = engine.prefill([PrefillRequest(other, blocks_for(engine, alloc, 104), 0)])

    assert max_rel_err(reused, scratch.prefill_logits) <= TOL
    for layer in range(2):
        k, v = engine.runner.pool.read_positions(layer, first, 100)
        assert torch.equal(k, before[layer][0])
        assert torch.equal(v, before[layer][1])


def test_prefill_batch_of_mixed_lengths_matches_single_prefills(
    engine: Engine, alloc: BlockAllocator
) -> None:
    specs = [(37, 0), (16, 15), (90, 32), (5, 4), (130, 77)]  # (N, M)
    prompts = [random_prompt(i, n, engine.vocab_size) for i, (n, _) in enumerate(specs)]
    solo_logits, batch = [], []
    for prompt, (n, m) in zip(prompts, specs, strict=True):
        solo_table, batch_table = blocks_for(engine, alloc, n), blocks_for(engine, alloc, n)
        if m:
            engine.prefill([PrefillRequest(prompt[:m], solo_table, 0)])
            engine.prefill([PrefillRequest(prompt[:m], batch_table, 0)])
        out = engine.prefill([PrefillRequest(prompt, solo_table, m)])
        solo_logits.append(out.prefill_logits[0])
        batch.append(PrefillRequest(prompt, batch_table, m))
    together = engine.prefill(batch).prefill_logits
    assert together.shape == (len(specs), engine.vocab_size)
    for i, expected in enumerate(solo_logits):
        assert max_rel_err(together[i], expected) <= TOL


def test_prefill_all_logits_match_prefix_prefills(engine: Engine, alloc: BlockAllocator) -> None:
    prompt = random_prompt(11, 40, engine.vocab_size)
    table = blocks_for(engine, alloc, 40)
    engine.prefill([PrefillRequest(prompt[:25], table, 0)])
    out = engine.prefill([PrefillRequest(prompt, table, 25)], all_logits=True)
    assert out.prefill_all_logits is not None
    every = out.prefill_all_logits[0]
    assert every.shape == (15, engine.vocab_size)
    assert max_rel_err(every[-1], out.prefill_logits[0]) <= TOL
    for end in (26, 33, 39):
        ref = engine.prefill([PrefillRequest(prompt[:end], blocks_for(engine, alloc, end), 0)])
        assert max_rel_err(every[end - 26], ref.prefill_logits[0]) <= TOL


def test_prefill_in_chunks_matches_one_prefill(engine: Engine, alloc: BlockAllocator) -> None:
    """Chunked prefill is a chain of prefills, each cached up to the previous chunk."""
    prompt = random_prompt(12, 150, engine.vocab_size)
    one = engine.prefill([PrefillRequest(prompt, blocks_for(engine, alloc, 150), 0)])
    table = blocks_for(engine, alloc, 150)
    done = 0
    for end in (48, 61, 128, 150):
        out = engine.prefill([PrefillRequest(prompt[:end], table, done)])
        done = end
    assert max_rel_err(out.prefill_logits, one.prefill_logits) <= TOL


def test_step_mixes_prefill_and_decode(engine: Engine, alloc: BlockAllocator) -> None:
    a = random_prompt(13, 30, engine.vocab_size)
    b = random_prompt(14, 45, engine.vocab_size)
    ta, tb = blocks_for(engine, alloc, 31), blocks_for(engine, alloc, 45)
    engine.prefill([PrefillRequest(a, ta, 0)])
    alone_decode = engine.decode([DecodeRequest(5, 30, ta)])
    alone_prefill = engine.prefill([PrefillRequest(b, tb, 0)]).prefill_logits
    tb2 = blocks_for(engine, alloc, 45)
    mixed = engine.step([PrefillRequest(b, tb2, 0)], [DecodeRequest(5, 30, ta)])
    assert max_rel_err(mixed.prefill_logits, alone_prefill) <= TOL
    assert max_rel_err(mixed.decode_logits, alone_decode) <= TOL


@pytest.mark.parametrize(
    ("n", "m", "problem"),
    [
        (10, 10, "num_cached_tokens"),
        (10, -1, "num_cached_tokens"),
        (40, 0, "block table has"),
    ],
)
def test_prefill_rejects_bad_requests(engine: Engine, n: int, m: int, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        engine.prefill([PrefillRequest([1] * n, [0, 1], m)])


def test_prefill_rejects_bad_block_and_token_ids(engine: Engine) -> None:
    with pytest.raises(ValueError, match="block id"):
        engine.prefill([PrefillRequest([1] * 4, [engine.num_blocks], 0)])
    with pytest.raises(ValueError, match="token ids"):
        engine.prefill([PrefillRequest([engine.vocab_size], [0], 0)])
    with pytest.raises(ValueError, match="at least one"):
        engine.step()


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_prefill_query_chunks_match_full_prefill(
    engine: Engine, alloc: BlockAllocator, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Long suffixes attend in query chunks; chunk edges must not change anything."""
    prompt = random_prompt(15, 120, engine.vocab_size)
    full = engine.prefill([PrefillRequest(prompt, blocks_for(engine, alloc, 120), 0)])
    table = blocks_for(engine, alloc, 120)
    engine.prefill([PrefillRequest(prompt[:21], table, 0)])
    monkeypatch.setattr(attention, "QUERY_CHUNK", chunk)
    out = engine.prefill([PrefillRequest(prompt, table, 21)], all_logits=True)
    assert out.prefill_all_logits is not None
    assert max_rel_err(out.prefill_logits, full.prefill_logits) <= TOL
    ref = engine.prefill([PrefillRequest(prompt[:50], blocks_for(engine, alloc, 50), 0)])
    assert max_rel_err(out.prefill_all_logits[0][50 - 22], ref.prefill_logits[0]) <= TOL
