"""Where weights come from: a seeded random source, a HF safetensors folder or a GGUF file.

All hand out tensors by their Hugging Face Llama names, already cut to one tensor
parallel rank's shard, so the model never sees a full tensor it does not keep.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from cachepoint.engine.config import ModelConfig
from cachepoint.engine.gguf_loader import GGUFWeights, read_gguf_config
from cachepoint.engine.sharding import cut_shard, shard_dim, shard_range
from cachepoint.tokenizer.gguf_vocab import is_gguf


class WeightSource(Protocol):
    """Hands out (sharded) weights by HF name."""

    def get(self, name: str, rank: int, world: int) -> torch.Tensor | None:
        """The tensor's shard for ``rank`` of ``world``, or None when the source lacks it."""
        ...


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every weight a Llama checkpoint holds, by HF name."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * d, h)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (config.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (config.num_kv_heads * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


class RandomWeights:
    """Seeded random weights: the same seed gives the same model on any machine or rank.

    NOTE: each tensor draws from its own generator seeded by (seed, name), so a rank
    can build just the tensors it needs, one at a time, and still agree with a
    single-rank model bit for bit.
    """

    __slots__ = ("_seed", "_shapes", "std")

    def __init__(self, config: ModelConfig, seed: int, std: float = 0.02) -> None:
        self._shapes = hf_weight_shapes(config)
        self._seed = seed
        self.std = std  # init std of matrices; norms are 1 + 0.1 * N(0, 1)

    def full(self, name: str) -> torch.Tensor:
        """The unsharded float32 tensor for ``name``."""
        shape = self._shapes[name]
        gen = torch.Generator(device="cpu")
        gen.manual_seed((self._seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # NOTE: not all ones, so that a swapped or dropped norm changes the output
            # and the checkpoint round-trip test can see it.
            return 1.0 + 0.1 * noise
        return noise * self.std

    def get(self, name: str, rank: int, world: int) -> torch.Tensor | None:
        if name not in self._shapes:
            return None
        return cut_shard(self.full(name), name, rank, world)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every full tensor by HF name (for writing a checkpoint folder)."""
        return {name: self.full(name) for name in self._shapes}


class SafetensorsWeights:
    """The ``*.safetensors`` files of a HF checkpoint folder, read lazily per slice."""

    __slots__ = ("_files", "_stack")

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        paths = sorted(Path(folder).glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors files in {folder}")
        self._stack = ExitStack()
        self._files: dict[str, Any] = {}
        for path in paths:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                self._files[key] = handle

    def names(self) -> Iterator[str]:
        return iter(self._files)

    def get(self, name: str, rank: int, world: int) -> torch.Tensor | None:
        handle = self._files.get(name)
        if handle is None:
            return None
        dim = shard_dim(name)
        if dim is None or world == 1:
            full: torch.Tensor = handle.get_tensor(name)
            return full
        # NOTE: get_slice reads only this rank's rows/columns from disk.
        sl = handle.get_slice(name)
        start, stop = shard_range(sl.get_shape()[dim], rank, world)
        part: torch.Tensor = sl[start:stop] if dim == 0 else sl[:, start:stop]
        return part

    def close(self) -> None:
        self._stack.close()


def read_hf_config(folder: Path) -> ModelConfig:
    """``ModelConfig`` from a checkpoint folder's ``config.json``."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a Hugging Face checkpoint folder")
    return ModelConfig.from_hf_config(json.loads(path.read_text()))


def read_model_config(checkpoint: Path) -> ModelConfig:
    """``ModelConfig`` of a checkpoint: a HF folder, or a ``.gguf`` file's metadata."""
    if is_gguf(checkpoint):
        return read_gguf_config(checkpoint)
    return read_hf_config(checkpoint)


def open_weights(checkpoint: Path, config: ModelConfig) -> SafetensorsWeights | GGUFWeights:
    """The weight source of a checkpoint (call ``close()`` on it when the model is built)."""
    if is_gguf(checkpoint):
        return GGUFWeights(checkpoint, config)
    return SafetensorsWeights(checkpoint)
