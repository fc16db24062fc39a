"""Which part of each Hugging Face Llama weight a tensor-parallel rank keeps.

Every weight source (random, safetensors, GGUF) cuts by these rules, so it sits below
all of them.
"""

from __future__ import annotations

import re

import torch

# Column-parallel weights split their output rows (dim 0), row-parallel ones their
# input columns (dim 1); everything else is replicated on every rank.
# A column-parallel layer's bias (Qwen2's q/k/v) splits with its output rows.
_COLUMN_PARALLEL = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")


def shard_dim(name: str) -> int | None:
    """The dimension a HF weight is split along under tensor parallelism, or None."""
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    return None


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s equal share of ``size`` (which ``world`` divides)."""
    if size % world:
        raise ValueError(f"dimension {size} does not split into {world} equal shards")
    step = size // world
    return rank * step, (rank + 1) * step


def cut_shard(t: torch.Tensor, name: str, rank: int, world: int) -> torch.Tensor:
    """``rank``'s tensor-parallel shard of the full tensor ``t`` named ``name``."""
    dim = shard_dim(name)
    if dim is None or world == 1:
        return t
    start, stop = shard_range(t.shape[dim], rank, world)
    return t.narrow(dim, start, stop - start)
