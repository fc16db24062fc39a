"""KV pool sizing and slot addressing."""

from __future__ import annotations

import pytest
import torch

from cachepoint.engine import Engine, EngineConfig, KVBudgetError, KVPool, ModelConfig
from cachepoint.engine.kv_pool import (
    KVPoolShape,
    block_bytes,
    blocks_for_budget,
    cuda_kv_budget,
    slot_mapping,
)


def test_kv_pool_sizing_from_a_byte_budget_gives_whole_blocks() -> None:
    per_block = block_bytes(2, 16, 2, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert blocks_for_budget(100 * per_block, per_block, min_blocks=10) == 100
    assert blocks_for_budget(100 * per_block - 1, per_block, min_blocks=10) == 99


def test_kv_pool_sizing_rejects_a_too_small_budget() -> None:
    with pytest.raises(KVBudgetError, match=r"holds 3 blocks.*at least 8"):
        blocks_for_budget(3 * 1024 + 5, 1024, min_blocks=8)


def test_kv_pool_engine_sized_from_config_budget() -> None:
    mc = ModelConfig.tiny(max_position_embeddings=256)
    per_token = mc.kv_bytes_per_token()
    assert per_token == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    engine = Engine(mc, EngineConfig(block_size=16, device="cpu", kv_cache_bytes=per_token * 1000))
    assert engine.num_blocks == 1000 // 16
    assert engine.kv_pool_bytes == engine.num_blocks * 16 * per_token


def test_kv_pool_engine_refuses_a_budget_below_one_full_sequence() -> None:
    mc = ModelConfig.tiny(max_position_embeddings=256)
    small = EngineConfig(device="cpu", kv_cache_bytes=mc.kv_bytes_per_token() * 255)
    with pytest.raises(KVBudgetError, match="max_model_len"):
        Engine(mc, small)
    # A shorter max_model_len makes the same budget enough.
    small.max_model_len = 128
    assert Engine(mc, small).num_blocks == 255 // 16


def test_kv_pool_cuda_budget_subtracts_weights_and_reserve() -> None:
    gib = 2**30
    assert cuda_kv_budget(80 * gib, 0.9, 16 * gib, 2 * gib) == int(72 * gib) - 18 * gib


def test_kv_pool_slot_mapping_follows_the_block_table() -> None:
    table = torch.tensor([7, 2, 5])
    slots = slot_mapping(table, 2, 10, block_size=4)
    assert slots.tolist() == [30, 31, 8, 9, 10, 11, 20, 21]


def test_kv_pool_write_then_gather_round_trips() -> None:
    shape = KVPoolShape(2, 8, 4, 2, 3, torch.float32)
    pool = KVPool(shape, torch.device("cpu"))
    table = [6, 1, 3]
    k = torch.randn(10, 2, 3)
    v = torch.randn(10, 2, 3)
    pool.write(1, slot_mapping(torch.tensor(table), 0, 10, 4), k, v)
    got_k, got_v = pool.read_positions(1, table, 10)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, v)
    assert torch.equal(pool.key(1)[1, 2], k[6])  # position 6 = block table[1], slot 2
    assert pool.key(0).abs().sum() == 0  # other layers untouched


def test_kv_pool_gather_blocks_gives_attentions_layout() -> None:
    """Whole blocks, head-major: [Hkv, nb*B, D] for one table, [batch, Hkv, nb*B, D]
    for several; position p of a table is row p, whatever block holds it."""
    shape = KVPoolShape(2, 8, 4, 2, 3, torch.float32)
    pool = KVPool(shape, torch.device("cpu"))
    tables = [[6, 1, 3], [2, 0, 7]]
    ks = [torch.randn(12, 2, 3) for _ in tables]
    vs = [torch.randn(12, 2, 3) for _ in tables]
    for table, k, v in zip(tables, ks, vs, strict=True):
        pool.write(0, slot_mapping(torch.tensor(table), 0, 12, 4), k, v)
    k1, v1 = pool.gather_blocks(0, torch.tensor(tables[0]))
    assert k1.shape == (2, 12, 3)
    assert torch.equal(k1, ks[0].transpose(0, 1)) and torch.equal(v1, vs[0].transpose(0, 1))
    kb, vb = pool.gather_blocks(0, torch.tensor(tables))
    assert kb.shape == (2, 2, 12, 3)
    for i in range(2):
        assert torch.equal(kb[i], ks[i].transpose(0, 1))
        assert torch.equal(vb[i], vs[i].transpose(0, 1))
    # A slice of a block's positions is the same as the token-by-token gather.
    got_k, _ = pool.read_positions(0, tables[1], 7)
    assert torch.equal(got_k, ks[1][:7])
