"""A GGUF file as a checkpoint: its ``ModelConfig`` and its weights by HF Llama name.

Weights are dequantized with ``gguf.quants.dequantize`` (Q4_1, Q8_0, F16, F32, ...)
to float32 one tensor at a time, when the model asks for it, and cut to the rank's
tensor-parallel shard like the safetensors source.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachepoint.engine.config import ModelConfig
from cachepoint.engine.sharding import cut_shard
from cachepoint.tokenizer.gguf_vocab import gguf_eos_ids, gguf_field, gguf_reader

# HF Llama name -> llama.cpp tensor name (per layer, "{i}" is the layer index).
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SUPPORTED_ARCHS = ("llama",)


def gguf_tensor_name(hf_name: str) -> str | None:
    """The llama.cpp name of a HF Llama weight, or None for a name with no counterpart."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    llama.cpp rotates interleaved pairs ``(x0, x1), (x2, x3)...``; HF rotates halves
    ``(x_i, x_{i+d/2})``. The converter reorders each head's rows from the HF layout
    to the interleaved one; this is the exact inverse, as in transformers'
    ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _arch(path: Path | str) -> str:
    arch = str(gguf_field(path, "general.architecture", ""))
    if arch not in _SUPPORTED_ARCHS:
        supported = ", ".join(_SUPPORTED_ARCHS)
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    return arch


def read_gguf_config(path: Path | str) -> ModelConfig:
    """``ModelConfig`` from a GGUF file's ``<arch>.*`` metadata."""
    arch = _arch(path)

    def key(name: str, default: Any = None) -> Any:
        return gguf_field(path, f"{arch}.{name}", default)

    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        # NOTE: refuse rather than run with the wrong rotary frequencies.
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    tokens = gguf_field(path, "tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"{path} states no vocabulary size")
    names = {t.name for t in gguf_reader(path).tensors}
    bos = gguf_field(path, "tokenizer.ggml.bos_token_id")
    eos = gguf_eos_ids(path)
    return ModelConfig(
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv") or num_heads),
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 4096)),
        # NOTE: every tensor is dequantized to float32; the engine casts to its dtype.
        dtype="float32",
        head_dim=int(key("attention.key_length") or hidden // num_heads),
        # NOTE: a file without output.weight reuses the token embedding as lm_head.
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos[0] if eos else None,
        eos_token_ids=eos,
    )


class GGUFWeights:
    """The tensors of a GGUF file, dequantized to float32 and served by HF Llama name."""

    __slots__ = ("_heads", "_path", "_tensors")

    def __init__(self, path: Path | str, config: ModelConfig | None = None) -> None:
        config = config or read_gguf_config(path)
        self._path = Path(path)
        self._tensors: dict[str, Any] = {t.name: t for t in gguf_reader(path).tensors}
        # Rows of Q and K are permuted per head: Q over query heads, K over KV heads.
        self._heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}

    def full(self, name: str) -> torch.Tensor | None:
        """The unsharded float32 tensor for HF ``name``, or None when the file lacks it."""
        from gguf.quants import dequantize

        gname = gguf_tensor_name(name)
        tensor = None if gname is None else self._tensors.get(gname)
        if gname is None or tensor is None:
            return None
        # NOTE: GGUF lists dims fastest-first (ggml's ne); numpy/torch want them reversed.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape(shape)
        n_head = self._heads.get(gname.split(".", 2)[-1])
        if n_head is not None:
            w = unpermute_rotary_rows(w, n_head)
        # NOTE: copy out of the memory map (and the read-only dequantized view).
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def get(self, name: str, rank: int, world: int) -> torch.Tensor | None:
        full = self.full(name)
        return None if full is None else cut_shard(full, name, rank, world)

    def close(self) -> None:
        """Nothing to release: the reader's memory map is shared and cached."""
