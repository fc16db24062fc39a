"""Rotary position embeddings in the Hugging Face Llama ("rotate_half") convention.

HF Llama checkpoints permute q/k projection rows so that the two halves of each head
(not interleaved pairs) form the rotated planes; applying RoPE any other way gives a
real checkpoint garbage output.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, with HF's llama3/linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    factor = float(rope_scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class Rotary:
    """Cos/sin for absolute token positions, computed on the fly for each forward.

    NOTE: no precomputed table: for 128k-context checkpoints it would cost more memory
    than the per-forward ``[tokens, head_dim]`` products it saves.
    """

    __slots__ = ("inv_freq",)

    def __init__(
        self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, device: torch.device
    ) -> None:
        self.inv_freq = inverse_frequencies(head_dim, theta, rope_scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[tokens, 1, head_dim]`` in ``dtype``, for int positions."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by the positions' angles."""
    return x * cos + rotate_half(x) * sin
