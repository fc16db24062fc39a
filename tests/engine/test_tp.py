"""Tensor parallelism: two gloo ranks on the CPU give the single-rank model's logits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from cachepoint.engine import (
    BlockAllocator,
    DecodeRequest,
    Engine,
    EngineConfig,
    GenerationRequest,
    ModelConfig,
    PrefillRequest,
    SamplingParams,
)

from .helpers import TOL, max_rel_err, random_prompt

MODEL = ModelConfig.tiny(
    num_heads=8,
    num_kv_heads=4,
    hidden_size=128,
    intermediate_size=256,
    max_position_embeddings=1024,
)


def config(tp: int) -> EngineConfig:
    return EngineConfig(
        device="cpu", kv_cache_bytes=4 << 20, tensor_parallel_size=tp, dist_timeout_s=60
    )


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    single = Engine(MODEL, config(1), seed=3)
    with Engine(MODEL, config(2), seed=3) as pair:
        yield single, pair
    assert not dist.is_initialized()


def test_tp_pools_split_heads_and_share_block_ids(engines: tuple[Engine, Engine]) -> None:
    single, pair = engines
    assert pair.runner.pool.shape.num_kv_heads == MODEL.num_kv_heads // 2
    # A per-rank byte budget holds twice the blocks when each rank keeps half the heads.
    assert pair.num_blocks == 2 * single.num_blocks


def test_tp2_prefill_and_decode_equal_tp1(engines: tuple[Engine, Engine]) -> None:
    single, pair = engines
    prompts = [random_prompt(70 + i, n, MODEL.vocab_size) for i, n in enumerate((45, 19, 80))]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    for eng in (single, pair):
        eng.prefill([PrefillRequest(prompts[2][:32], tables[2], 0)])
    batch = [
        PrefillRequest(prompts[0], tables[0], 0),
        PrefillRequest(prompts[1], tables[1], 0),
        PrefillRequest(prompts[2], tables[2], 32),  # reuses the cached 32 tokens
    ]
    want = single.prefill(batch).prefill_logits
    got = pair.prefill(batch).prefill_logits
    assert max_rel_err(got, want) <= TOL

    decodes = [DecodeRequest(3, 45, tables[0]), DecodeRequest(9, 80, tables[2])]
    assert max_rel_err(pair.decode(decodes), single.decode(decodes)) <= TOL


def test_tp2_greedy_generation_equals_tp1(engines: tuple[Engine, Engine]) -> None:
    single, pair = engines
    prompt = random_prompt(80, 50, MODEL.vocab_size)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = [
        eng.generate([GenerationRequest(prompt, params)], BlockAllocator(single.num_blocks))[0]
        for eng in (single, pair)
    ]
    assert got[0].token_ids == got[1].token_ids


def test_tp2_fault_hook_aborts_every_rank_and_the_group_survives(
    engines: tuple[Engine, Engine],
) -> None:
    single, pair = engines
    prompt = random_prompt(90, 40, MODEL.vocab_size)
    table = list(range(40, 43))

    def hook(layer: int) -> None:
        if layer == 1:
            raise KeyboardInterrupt  # even a BaseException must not strand the workers

    pair.fault_hook = hook
    try:
        with pytest.raises(KeyboardInterrupt):
            pair.prefill([PrefillRequest(prompt, table, 0)])
    finally:
        pair.fault_hook = None
    want = single.prefill([PrefillRequest(prompt, table, 0)]).prefill_logits
    assert max_rel_err(pair.prefill([PrefillRequest(prompt, table, 0)]).prefill_logits, want) <= TOL
