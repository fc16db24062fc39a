"""The engine's matrix products, on oneDNN where the CPU build has it.

torch's ``F.linear`` on the CPU goes to MKL's sgemm/sgemv. On this AMD EPYC (and on
AMD generally, where MKL takes a generic path) that is far off the memory bandwidth:
SmolLM2-135M's 540 MB of float32 weights took 50 ms a decode step through MKL and
27-32 ms through oneDNN's matmul, which torch ships as the op Inductor uses for CPU
linears (``mkldnn._linear_pointwise``); 73-92 against 48-55 ms at 8 rows, and
1.0 against 0.8 s at 512 (measured here, bench/RESULTS.md). The results agree with
MKL's to float32 rounding (a different summation order).

oneDNN costs about 20 us a call more than MKL, so small weights stay on MKL (a
128 x 64 projection: 2.7 against 20.7 us). On Intel CPUs MKL's one-row product
(sgemv) is the faster one: SmolLM2's weights at one row took 21.4 ms on MKL and 30.5
on oneDNN (26.5 against 18.8 GB/s, a plain read being 23.5), and 52.9 against 43.2 ms
at 8 rows (a Xeon with AVX-512, bench/RESULTS.md); so there a single row stays on MKL.
Elsewhere (CUDA, a build without oneDNN, dtypes oneDNN does not take) it is
``F.linear``.

A decode batch of 2 to 16 rows in float32 goes to our own kernel
(``cpu_kernels.small_matmul``): it streams each weight once for all the rows, where
both libraries' blocked GEMMs ran at 10-16 GB/s. Measured here over every linear of a
step: 3.5 against 6.3 ms (oneDNN) at 8 rows on engine_bench's 25.6M model, 30.5
against 44.3 ms on SmolLM2's, and 7.5 against 8.6 / 43.8 against 51.9 at 16 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels

# NOTE: private (Inductor's CPU lowering calls it), so looked up once and optional.
_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
USE_ONEDNN = _ONEDNN is not None and torch.backends.mkldnn.is_available()

# NOTE: measured here at one row: 576 x 576 took 27.6 us on MKL and 45.8 on oneDNN,
# 960 x 576 took 57.9 and 34.3; oneDNN wins from about half a million weights up. In
# a SmolLM2 decode step (every weight streamed from memory) its 576 x 576 o_proj took
# 123 us on MKL and 187 on oneDNN, so the line holds there too.
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
