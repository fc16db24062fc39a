"""The engine's own CPU attention kernels (``csrc/``): built once, then loaded.

- ``paged_prefill``: a prefill's rows over its whole context (cached blocks and its
  own), causal lower-right, through its block table;
- ``paged_decode``: decode lanes over their contexts through their block tables, each
  lane's keys split in chunks across the threads (flash-decoding);
- ``small_matmul``: the linears of a decode batch of 2 to 16 rows (see :mod:`.linear`);
- ``rms_norm``, ``add_rms_norm_``, ``rotary_``, ``silu_and_mul``: a decoder layer's
  elementwise steps, one pass each (see :mod:`.layer_ops`).

The kernels are compiled against the installed torch with ``torch.utils.cpp_extension``
(g++ and ninja) into a folder keyed by a digest of its source, the torch version and
the flags, so a changed source or a new torch builds afresh and a stale library is
never loaded. ``make install`` and the replica image build it ahead of time
(``python -m cachepoint.engine.build_kernel``); a replica that finds no built library
builds it on first use (about 20 s), and one that cannot (no compiler, no AVX-512)
logs why once and attends with torch's flash kernel instead. Nothing else changes:
the kernel is an accelerator, never a requirement.

Settings (environment):

- ``CACHEPOINT_KERNEL_CACHE``: where built libraries live (default: the Python
  environment's ``share/cachepoint/kernels``, else ``~/.cache/cachepoint/kernels``);
- ``CACHEPOINT_CPU_KERNELS=0``: never load it (torch's kernels only).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / f
    for f in ("paged_prefill.cpp", "paged_decode.cpp", "small_matmul.cpp", "layer_ops.cpp")
)
# NOTE: the headers the sources include: not compiled on their own, but they shape the
# binary, so they are part of its name (a changed header must not load a stale build).
HEADERS = (Path(__file__).with_name("csrc") / "vec_math.h",)
# NOTE: -fopenmp makes at::parallel_for parallel (it is an OpenMP pragma in a header);
# the library then links libgomp.so.1, which resolves to the copy torch already loaded,
# so the kernel runs on torch's own thread team and honours torch.set_num_threads.
FLAGS = ("-O3", "-mavx512f", "-mfma", "-fno-math-errno", "-fopenmp")
ENV_CACHE = "CACHEPOINT_KERNEL_CACHE"
ENV_SWITCH = "CACHEPOINT_CPU_KERNELS"


def cache_root() -> Path:
    """The folder built libraries live under."""
    configured = os.environ.get(ENV_CACHE)
    if configured:
        return Path(configured)
    share = Path(sys.prefix) / "share" / "cachepoint" / "kernels"
    if os.access(sys.prefix, os.W_OK) or share.exists():
        return share
    return Path.home() / ".cache" / "cachepoint" / "kernels"


def library_name() -> str:
    """The build's name: a digest of what shapes the binary."""
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(FLAGS).encode())
    return f"cachepoint_cpu_{h.hexdigest()[:12]}"


def library_path() -> Path:
    name = library_name()
    return cache_root() / name / f"{name}.so"


def why_unavailable() -> str | None:
    """Why this process cannot use the kernel at all (before any build), or None."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_SWITCH}=0"
    if sys.platform != "linux":
        return f"the kernel is built for Linux, not {sys.platform}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"this CPU runs torch's {capability} kernels, not AVX512"
    return None


def build(verbose: bool = False) -> Path:
    """Compile the kernel (and load it into this process); returns the library."""
    from torch.utils import cpp_extension  # NOTE: imports setuptools; only when building

    name = library_name()
    folder = cache_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=list(FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=verbose,
    )
    return folder / f"{name}.so"


@functools.cache
def load() -> bool:
    """Load the kernel once per process, building it if needed; False when it cannot
    be had (the reason is logged once)."""
    why = why_unavailable()
    if why is None:
        path = library_path()
        try:
            if path.exists():
                torch.ops.load_library(str(path))
            else:
                log.info("building the CPU attention kernel into %s (once)", path.parent)
                build()
            return True
        except Exception as exc:  # no compiler, a read-only cache, a broken build
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    log.warning("CPU attention kernel unavailable (%s): using torch's flash kernel", why)
    return False


# NOTE: the kernel's FMAs per score grow with head_dim, while torch's flash kernel
# turns its tiles into GEMMs whose inner dimension is head_dim. Once its threads were
# balanced (the zigzag in csrc/paged_prefill.cpp), it took 0.29-0.86x torch's time at
# head_dim 16, 32 and 64, cold and cached, and 0.97-2.16x at 128 (bench/RESULTS.md,
# "the cold prefill caught up", part 2): past 64, torch's kernel serves.
MAX_HEAD_DIM = 64


def _ops() -> Any:
    if not load():
        raise RuntimeError(f"the CPU attention kernel is unavailable: {why_unavailable()}")
    return torch.ops.cachepoint


def paged_prefill_supported(q: torch.Tensor, pool_dtype: torch.dtype) -> bool:
    """Whether :func:`paged_prefill` takes these queries over a pool of ``pool_dtype``
    (and is the faster way to: see :data:`MAX_HEAD_DIM`)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and pool_dtype == torch.float32
        and q.shape[-1] <= MAX_HEAD_DIM
        and load()
        and bool(torch.ops.cachepoint.paged_prefill_supports(q.shape[-1]))
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cached: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` ``[n, Hq, D]`` (positions ``cached..cached+n-1``) over
    the sequence's first ``cached + n`` slots, read through ``block_table`` (int32 pool
    block ids) from ``k_cache``/``v_cache`` ``[Hkv, blocks, block_size, D]``; returns
    the output ``[n, Hq, D]`` and its log-sum-exp ``[n, Hq]``."""
    return _ops().paged_prefill(q, k_cache, v_cache, block_table, cached, scale)


def paged_decode_supported(q: torch.Tensor, pool_dtype: torch.dtype, kv_heads: int) -> bool:
    """Whether :func:`paged_decode` takes these decode queries over a pool of
    ``pool_dtype`` with ``kv_heads`` KV heads."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and pool_dtype == torch.float32
        and load()
        and bool(torch.ops.cachepoint.paged_decode_supports(q.shape[-1], q.shape[1] // kv_heads))
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    start: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of decode rows ``q`` ``[lanes, Hq, D]``, lane ``i`` over its keys
    ``start..lengths[i]-1`` read through ``block_tables[i]`` (int32 pool block ids;
    ``lengths`` int64); returns the output ``[lanes, Hq, D]`` and its log-sum-exp
    ``[lanes, Hq]`` (-inf and output 0 for a lane with no keys in the range)."""
    return _ops().paged_decode(q, k_cache, v_cache, block_tables, lengths, start, scale)


def small_matmul_supported() -> bool:
    """Whether :func:`small_matmul` can run in this process."""
    return load()


def small_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of 1 to 16 float32 rows ``[m, K]`` and
    ``weight`` ``[N, K]`` with contiguous rows; returns ``[m, N]``."""
    out: torch.Tensor = _ops().small_matmul(x, weight, bias)
    return out


def layer_ops_supported(x: torch.Tensor) -> bool:
    """Whether the elementwise layer ops (:mod:`.layer_ops`) take ``x``."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` of float32 rows ``x`` ``[rows, H]`` times ``weight`` ``[H]``."""
    out: torch.Tensor = _ops().rms_norm(x, weight, eps)
    return out


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += delta`` in place, then :func:`rms_norm` of the sum (a new tensor)."""
    out: torch.Tensor = _ops().add_rms_norm_(residual, delta, weight, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` ``[tokens, heads, D]`` in place by ``cos``/``sin`` ``[tokens, D]``."""
    _ops().rotary_(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` ``[rows, 2I]`` holding gate and up side by side."""
    out: torch.Tensor = _ops().silu_and_mul(x)
    return out
