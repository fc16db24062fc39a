"""A decoder layer's elementwise steps: the engine's one-pass kernels on a float32 CPU,
torch's ops everywhere else (CUDA, bfloat16, a CPU without the kernels).

- :func:`rms_norm`: the RMS norm of rows times its weight;
- :func:`add_rms_norm_`: the residual add that closes a sublayer fused with the norm
  that opens the next (``residual`` is updated in place);
- :func:`rotate`: the rotary embedding of query and key heads, in place where it can;
- :func:`silu_and_mul`: the gated MLP's ``silu(gate) * up``.

NOTE: every function gives what the torch expression in its fallback gives, to float32
rounding (the rotation exactly); the kernels exist because torch runs each of these as
a chain of ops over fresh buffers (csrc/layer_ops.cpp says how many, bench/RESULTS.md
"One pass for the elementwise ops" what it cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cachepoint.engine import cpu_kernels
from cachepoint.engine.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dimension."""
    if (
        cpu_kernels.layer_ops_supported(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and weight.dtype == torch.float32
    ):
        return cpu_kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # NOTE: normalise in float32 like HF does; bf16 variance loses too much.
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` (in place), then :func:`rms_norm` of the updated residual."""
    if (
        cpu_kernels.layer_ops_supported(residual)
        and residual.dim() == 2
        and residual.stride(-1) == 1
        and delta.dtype == weight.dtype == torch.float32
        and delta.shape == residual.shape
        and delta.stride(-1) == 1
    ):
        return cpu_kernels.add_rms_norm_(residual, delta, weight, eps)
    residual.add_(delta)
    return rms_norm(residual, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tokens, heads, D]`` rotated by ``cos``/``sin`` ``[tokens, 1, D]``.

    On the kernel's path ``x`` itself is rotated and returned (no new buffer); the
    caller must not need the unrotated values. Elsewhere a new tensor is returned.
    """
    if (
        cpu_kernels.layer_ops_supported(x)
        and x.stride(-1) == 1
        and x.dim() == 3
        and cos.dtype == sin.dtype == torch.float32
        and cos.shape == sin.shape
        and cos.numel() == x.shape[0] * x.shape[-1]
    ):
        tokens = x.shape[0]
        cos2, sin2 = cos.reshape(tokens, -1).contiguous(), sin.reshape(tokens, -1).contiguous()
        cpu_kernels.rotary_(x, cos2, sin2)
        return x
    return apply_rotary(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2I]`` (gate first, then up)."""
    if cpu_kernels.layer_ops_supported(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up
