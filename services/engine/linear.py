"""The engine's matrix products, on oneDNN where the CPU build has it.

torch's ``F.linear`` on the CPU goes to MKL's sgemm/sgemv, which on AMD takes a
generic path far off the memory bandwidth; oneDNN's matmul, which torch ships as the op
Inductor uses for CPU linears (``mkldnn._linear_pointwise``), streams the weights
nearly twice as fast there (bench/RESULTS.md, "Bridged decode runs, multi-step decode,
oneDNN linears"). Its results agree with MKL's to float32 rounding (a different
summation order).

oneDNN costs about 20 us a call more than MKL, so small weights stay on MKL. On Intel
CPUs MKL's one-row product (sgemv) is the faster one and runs at the memory bandwidth,
so there a single row stays on MKL (bench/RESULTS.md, "CPU kernels"). Elsewhere (CUDA,
a build without oneDNN, dtypes oneDNN does not take) it is ``F.linear``.

A decode batch of 2 to 16 rows in float32 goes to our own kernel
(``cpu_kernels.small_matmul``): it streams each weight once for all the rows, where
both libraries' blocked GEMMs stream far below the bandwidth (bench/RESULTS.md, "CPU
kernels" and "CPU kernels on AMD").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cachepoint.engine import cpu_kernels

# NOTE: private (Inductor's CPU lowering calls it), so looked up once and optional.
_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
# NOTE: bfloat16 only where oneDNN has a bf16 inner product for this CPU (AVX512-BF16,
# AMX, ...): on an AVX2-only CPU it cannot build the primitive and raises, so bf16 takes
# F.linear there.
_BF16_OK = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16) if _BF16_OK else (torch.float32,)
USE_ONEDNN = _ONEDNN is not None and torch.backends.mkldnn.is_available()

# NOTE: oneDNN wins from about half a million weights up, at one row and within a
# decode step alike (bench/RESULTS.md, "Where the engine's CPU thresholds come from").
ONEDNN_MIN_WEIGHTS = 1 << 19


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``), or "" if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# NOTE: MKL picks its code paths by CPU vendor, so the vendor is what decides.
MKL_FOR_ONE_ROW = cpu_vendor() == "GenuineIntel"

# NOTE: the rows small_matmul takes, and the smallest weights it is given: it was
# measured on matrices of 196k weights and up; the tiny model's (8-16k) stay on MKL,
# where a call costs less.
SMALL_ROWS = range(2, 17)
SMALL_MIN_WEIGHTS = 1 << 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``F.linear``."""
    if (
        x.dim() == 2
        and x.shape[0] in SMALL_ROWS
        and weight.numel() >= SMALL_MIN_WEIGHTS
        and weight.stride(-1) == 1
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == "cpu"
        and cpu_kernels.small_matmul_supported()
    ):
        return cpu_kernels.small_matmul(x.contiguous(), weight, bias)
    if (
        USE_ONEDNN
        and weight.numel() >= ONEDNN_MIN_WEIGHTS
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and not (MKL_FOR_ONE_ROW and x.numel() == x.shape[-1])
    ):
        assert _ONEDNN is not None
        out: torch.Tensor = _ONEDNN(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)
