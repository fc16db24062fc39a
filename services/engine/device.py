"""Which device and dtype a rank runs on."""

from __future__ import annotations

import torch

from cachepoint.engine.config import normalize_dtype


def resolve_device(spec: str, tp_rank: int = 0) -> torch.device:
    """``auto`` means CUDA when available, else the CPU; TP rank ``r`` takes ``cuda:r``.

    NOTE: one rank per GPU of the pod, numbered like the ranks, is how the operator
    lays out a TP group; an explicit ``cuda:N`` pins a single-rank engine instead.
    """
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda", tp_rank)
    device = torch.device(spec)
    if device.type == "cuda" and tp_rank:
        raise ValueError("with tensor parallelism use device 'auto' or 'cuda', not 'cuda:N'")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on the CPU and bfloat16 on CUDA (float16 without bf16 support)."""
    if spec == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype: torch.dtype = getattr(torch, normalize_dtype(spec))
    return dtype
