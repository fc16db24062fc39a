"""Paged attention on CUDA: one kernel call that reads K/V through the block tables.

Backend: torch's own ``torch.nn.attention.varlen.varlen_attn`` with ``block_table``
and ``seqused_k`` (FlashAttention-2's paged varlen forward, ``mha_varlen_fwd`` in
``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``), not FlashInfer.

Why, and at what cost:

- Nothing to install. FlashInfer (``flashinfer-python``) is not in the project's
  dependencies, is not on the lent GPU machine (which has no network), and compiles its
  kernels with nvcc at first use (JIT) unless the several-hundred-MiB
  ``flashinfer-jit-cache``/``flashinfer-cubin`` wheels come along; that neither fits the
  64 MiB a device call carries nor a 5-minute check. ``varlen_attn`` ships compiled
  inside torch's CUDA wheels.
- One call serves the whole packed step (prefills with a cached prefix and decodes
  together); FlashAttention's causal mask is aligned to the bottom right, i.e. query
  ``i`` of a sequence with ``n`` queries over ``N`` keys sees keys ``0..N-n+i``: exactly
  the engine's lower-right causality, with no mask tensor.
- The price is the page size: FA2's paged path checks ``page_block_size % 256 == 0``
  ("Paged KV cache block size must be divisible by 256"). On CUDA the engine must run
  with ``EngineConfig(block_size=256)`` (or 512, ...); prefix reuse is then granular to
  256 tokens, which costs under 1% of a 30k-token agent prompt. FlashInfer accepts any
  page size; it is the upgrade path if 16-token granularity matters on GPU.
- dtype: bfloat16 or float16 only, the pool's dtype equal to the queries'; head_dim a
  multiple of 8, at most 256; compute capability 8.0 or newer.

Layout. The kernel takes K/V as ``[num_blocks, block_size, kv_heads, head_dim]``. It
only requires a unit stride on ``head_dim`` (``stride(-1) == 1``) and reads every other
dimension through its stride (``k_batch_stride = k.stride(0)``, ``k_row_stride =
k.stride(-3)``, ``k_head_stride = k.stride(-2)``, int64 ``index_t``), so the head-major
pool ``[kv_heads, num_blocks, block_size, head_dim]`` is passed as a permuted *view*,
without a copy: :func:`paged_kernel_inputs`. (Checked in the source, not yet on a GPU.)

API drift: ``varlen_attn``'s keyword arguments changed between torch releases (one
development line had ``page_table`` for FA3 only). :func:`cuda_paged_attention_available`
inspects the installed signature and says why not when ``block_table``/``seqused_k``
are missing, instead of failing inside a forward pass.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# FA2's paged varlen forward refuses other page sizes (flash_api.cpp, mha_varlen_fwd).
PAGE_MULTIPLE = 256
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@dataclass(slots=True)
class PagedKernelInputs:
    """The engine's attention metadata, converted to what ``varlen_attn`` reads."""

    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]: a view of the pool
    value: torch.Tensor  # same, for values
    cu_seqlens_k: torch.Tensor  # int32 [num_seqs + 1]: running sum of seq_lens
    seqused_k: torch.Tensor  # int32 [num_seqs]: keys each sequence attends over
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks], last dimension contiguous


def _varlen_attn() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _kernel_params() -> frozenset[str]:
    """Keyword names of the installed ``varlen_attn`` (empty without one)."""
    fn = _varlen_attn()
    return frozenset() if fn is None else frozenset(inspect.signature(fn).parameters)


@functools.cache
def _kernel_status(block_size: int, dtype: torch.dtype, device_index: int) -> tuple[bool, str]:
    if _varlen_attn() is None:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    params = _kernel_params()
    missing = [p for p in ("block_table", "seqused_k") if p not in params]
    if missing:
        return False, (
            f"torch {torch.__version__}'s varlen_attn lacks {', '.join(missing)} "
            "(paged KV needs both)"
        )
    if dtype not in KERNEL_DTYPES:
        return False, f"dtype {dtype} unsupported: FlashAttention takes bfloat16 or float16"
    if block_size <= 0 or block_size % PAGE_MULTIPLE:
        return False, (
            f"block_size {block_size} is not a multiple of {PAGE_MULTIPLE} "
            "(FlashAttention-2's paged KV page size)"
        )
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return False, f"compute capability {major}.{minor} < 8.0 (FlashAttention-2 needs Ampere+)"
    return True, "ok"


def cuda_paged_attention_available(block_size: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether :func:`cuda_paged_attention` can run for this pool, and if not, why.

    Checks the installed torch's ``varlen_attn`` (paged arguments), the dtype, the
    block size (a multiple of 256) and the current CUDA device (capability >= 8.0).
    Cached per (block_size, dtype, current device): cheap enough for every step.
    """
    index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return _kernel_status(block_size, dtype, index)


def paged_kernel_inputs(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> PagedKernelInputs:
    """Convert one layer's head-major pool and the step's metadata to the kernel's inputs.

    ``k_cache``/``v_cache``: ``[kv_heads, num_blocks, block_size, head_dim]``;
    ``seq_lens``: ``[num_seqs]``; ``block_tables``: ``[num_seqs, max_blocks]``. Runs on
    the device without a host sync (no ``.item()``), so it may sit inside a CUDA graph.
    Raises ``ValueError`` for shapes or layouts the kernel would misread.
    """
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [kv_heads, num_blocks, block_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim (stride(-1) == 1)")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share one layout (equal strides)")
    if block_tables.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError("block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs]")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"{block_tables.shape[0]} block tables for {seq_lens.shape[0]} sequence lengths"
        )
    lens = seq_lens.to(torch.int32).contiguous()
    cu_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, 0, dtype=torch.int32, out=cu_k[1:])
    return PagedKernelInputs(
        key=k_cache.permute(1, 2, 0, 3),
        value=v_cache.permute(1, 2, 0, 3),
        cu_seqlens_k=cu_k,
        seqused_k=lens,
        block_table=block_tables.to(torch.int32).contiguous(),
    )


def cuda_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """Lower-right causal attention of the packed queries over the paged pool.

    ``q``: ``[tokens, q_heads, head_dim]`` (prefill rows first, then one per decode);
    ``k_cache``/``v_cache``: one layer's ``[kv_heads, num_blocks, block_size, head_dim]``
    with the step's new K/V already written; ``cu_seqlens_q``: int32 ``[num_seqs + 1]``;
    ``seq_lens``: int32 ``[num_seqs]`` keys per sequence; ``block_tables``: int32
    ``[num_seqs, max_blocks]`` padded with 0. Returns ``[tokens, q_heads, head_dim]``.
    Raises ``RuntimeError`` naming the reason when the kernel cannot run here.
    """
    ok, why = cuda_paged_attention_available(k_cache.shape[2], q.dtype)
    if not ok:
        raise RuntimeError(f"CUDA paged attention unavailable: {why}")
    head_dim = q.shape[-1]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 8 and at most {MAX_HEAD_DIM}")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"pool dtype {k_cache.dtype} differs from the queries' {q.dtype}")
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_cache.shape[0]} KV heads")
    inputs = paged_kernel_inputs(k_cache, v_cache, seq_lens, block_tables)
    varlen_attn = _varlen_attn()
    assert varlen_attn is not None  # checked by cuda_paged_attention_available
    extra: dict[str, Any] = {}
    if "enable_gqa" in _kernel_params():
        # NOTE: torch 2.13 refuses fewer KV heads than query heads without it.
        extra["enable_gqa"] = q.shape[1] != k_cache.shape[0]
    out = varlen_attn(
        q,
        inputs.key,
        inputs.value,
        cu_seqlens_q.to(torch.int32),
        inputs.cu_seqlens_k,
        max_q,
        max_k,
        scale=1.0 / math.sqrt(head_dim),
        # NOTE: (-1, 0) is varlen_attn's spelling of is_causal; FA2 aligns it to the
        # bottom right, which is the cached-prefix (lower-right) mask.
        window_size=(-1, 0),
        seqused_k=inputs.seqused_k,
        block_table=inputs.block_table,
        **extra,
    )
    assert isinstance(out, torch.Tensor)
    return out


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """The same contract as :func:`cuda_paged_attention`, in float64 on any device.

    Gathers each sequence's blocks explicitly and applies an explicit lower-right causal
    mask: slow, for tests and ``bench/gpu_check.py``. ``max_q``/``max_k`` are checked
    against the metadata (a wrong bound would make a real kernel skip rows).
    """
    hkv, _nb, bs, d = k_cache.shape
    hq = q.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    if len(cu) != len(lens) + 1 or cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError("cu_seqlens_q must run from 0 to tokens with one entry per sequence + 1")
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, total in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        n = end - start
        if not 0 < n <= total:
            raise ValueError(f"sequence {i}: {n} queries over {total} keys")
        if n > max_q or total > max_k:
            raise ValueError(f"sequence {i}: ({n}, {total}) exceeds max_q/max_k ({max_q}, {max_k})")
        blocks = block_tables[i, : math.ceil(total / bs)].long()
        k = k_cache.index_select(1, blocks).reshape(hkv, -1, d)[:, :total].double()
        v = v_cache.index_select(1, blocks).reshape(hkv, -1, d)[:, :total].double()
        k = k.repeat_interleave(hq // hkv, dim=0)  # [hq, total, d]
        v = v.repeat_interleave(hq // hkv, dim=0)
        qs = q[start:end].double().transpose(0, 1)  # [hq, n, d]
        scores = qs @ k.transpose(1, 2) / math.sqrt(d)  # [hq, n, total]
        rows = torch.arange(n, device=q.device)[:, None] + (total - n)
        cols = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.to(q.dtype)
