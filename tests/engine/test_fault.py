"""The fault hook: an exception inside the forward pass leaves the engine usable."""

from __future__ import annotations

import random

import pytest

from cachepoint.engine import BlockAllocator, DecodeRequest, Engine, PrefillRequest

from .helpers import TOL, blocks_for, make_engine, max_rel_err, random_prompt


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def deep_engine() -> Engine:
    return make_engine(16, num_layers=6)


@pytest.mark.parametrize("seed", range(4))
def test_fault_hook_raising_at_a_random_layer_propagates_from_prefill(
    deep_engine: Engine, seed: int
) -> None:
    eng = deep_engine
    alloc = BlockAllocator(eng.num_blocks)
    rng = random.Random(seed)
    fail_at = rng.randrange(eng.model_config.num_layers)
    prompt = random_prompt(seed, rng.randrange(20, 90), eng.vocab_size)
    n = len(prompt)
    reached: list[int] = []

    def hook(layer: int) -> None:
        reached.append(layer)
        if layer == fail_at:
            raise InjectedFault(f"layer {layer}")

    table = blocks_for(eng, alloc, n)
    eng.fault_hook = hook
    try:
        with pytest.raises(InjectedFault, match=f"layer {fail_at}"):
            eng.prefill([PrefillRequest(prompt, table, 0)])
    finally:
        eng.fault_hook = None
    assert reached == list(range(fail_at + 1))

    # The same blocks, recomputed after the failure, hold what a clean run computes.
    again = eng.prefill([PrefillRequest(prompt, table, 0)]).prefill_logits
    clean_table = blocks_for(eng, alloc, n)
    clean = eng.prefill([PrefillRequest(prompt, clean_table, 0)]).prefill_logits
    assert max_rel_err(again, clean) <= TOL


def test_fault_hook_raising_aborts_a_decode_step(deep_engine: Engine) -> None:
    eng = deep_engine
    alloc = BlockAllocator(eng.num_blocks)
    prompt = random_prompt(99, 30, eng.vocab_size)
    table = blocks_for(eng, alloc, 31)
    eng.prefill([PrefillRequest(prompt, table, 0)])

    def hook(layer: int) -> None:
        if layer == 3:
            raise InjectedFault("decode")

    eng.fault_hook = hook
    try:
        with pytest.raises(InjectedFault):
            eng.decode([DecodeRequest(7, 30, table)])
    finally:
        eng.fault_hook = None
    assert eng.decode([DecodeRequest(7, 30, table)]).isfinite().all()
