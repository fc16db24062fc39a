"""Helpers shared by the engine tests (fixtures live in conftest.py)."""

from __future__ import annotations

import random

import torch

from cachepoint.engine import BlockAllocator, Engine, EngineConfig, ModelConfig

TOL = 1e-4  # the acceptance tolerance: relative error in float32


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``expected``.

    NOTE: relative to the tensor's scale, not per element: per-element relative error
    is meaningless for values near zero, which random K/V and logits are full of.
    """
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


def make_engine(block_size: int = 16, **model_overrides: object) -> Engine:
    return Engine(
        ModelConfig.tiny(**model_overrides),
        EngineConfig(block_size=block_size, device="cpu", kv_cache_bytes=16 << 20),
        seed=1234,
    )


def random_prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def blocks_for(engine: Engine, alloc: BlockAllocator, n: int) -> list[int]:
    """Fresh blocks enough for ``n`` tokens."""
    return alloc(-(-n // engine.block_size))
