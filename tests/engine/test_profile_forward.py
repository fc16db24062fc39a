"""The profiling forward that sizes a CUDA pool runs the largest step on a throwaway
pool and leaves the real pool and tables alone (run on the CPU here)."""

from __future__ import annotations

import math

import torch

from cachepoint.engine import EngineConfig, ModelConfig, PrefillRequest
from cachepoint.engine.runner import ModelRunner


def test_profile_forward_uses_a_throwaway_pool() -> None:
    config = EngineConfig(device="cpu", kv_cache_bytes=4 << 20, max_num_batched_tokens=100)
    runner = ModelRunner(ModelConfig.tiny(), config, seed=0)
    pool, tables = runner.pool, runner.tables
    runner.execute([PrefillRequest(list(range(1, 40)), [3, 4, 5], seq_id=7)], [])
    before = pool.segment(0, 3, 39)[0].clone()
    probe = runner.profile_forward()
    assert probe is not pool and probe.num_blocks == math.ceil(100 / config.block_size)
    assert bool(probe.segment(0, 0, 100)[0].abs().sum() > 0)  # the probe forward wrote K
    assert runner.pool is pool and runner.tables is tables and len(tables) == 1
    assert torch.equal(pool.segment(0, 3, 39)[0], before)
