"""Attention over the paged KV pool, reading the pool in place.

Each layer writes the step's new K/V into their pool slots, then attends. A sequence's
context arrives in pieces (see :mod:`.attention_plan`): runs of consecutive blocks read
as strided views of the pool, a few short runs gathered into one small buffer, and the
step's own new tokens. Each piece gives a partial attention and its log-sum-exp; the
pieces merge exactly (the online-softmax identity), so no piece ever needs the whole
context in one tensor, and nothing ``[queries, context]``-sized is ever built.

Why this and not a single kernel: on the CPU, torch's flash kernel is the fastest
attention there is, and the one entry that returns the log-sum-exp takes dense K/V, not
a block table. ``flex_attention`` with a block mask would read the table itself, but
on the CPU it needs an Inductor compile per shape (tens of seconds on 2 cores) and
decode shapes change every step. Runs keep the calls few: a prompt prefilled into a
fresh pool is one run, and a decode batch's shared prefix is one call for all lanes.

The new tokens attend to their own K/V directly, after a round trip through the pool's
dtype: exactly the values a later step reads back, so a cached prefill and a cold one
see bit-identical K/V whatever the pool's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cachepoint.engine import cpu_kernels
from cachepoint.engine.attention_cuda import cuda_paged_attention
from cachepoint.engine.attention_plan import AttentionMetadata, DecodeSpan, PrefillSpan
from cachepoint.engine.kv_pool import KVPool

Partial = tuple[torch.Tensor, torch.Tensor]
"""A partial attention: output ``[..., rows, D]`` and its float32 log-sum-exp ``[..., rows]``."""

# NOTE: private, but the only CPU SDPA entry that returns the log-sum-exp that merging
# partial attentions needs; absent (or for another dtype), the float32 math path runs.
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# NOTE: the math path's scores are [rows, keys] per head; rows in chunks of this many
# bound them to [QUERY_CHUNK, keys], linear in the context.
QUERY_CHUNK = 1024


def _use_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _CPU_FLASH is not None and q.dtype in _CPU_FLASH_DTYPES


def _flash_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None
) -> Partial:
    assert _CPU_FLASH is not None
    mask = None if bias is None else bias.to(q.dtype)
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask)[:2]
    return out, lse


def _math_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None
) -> Partial:
    """Plain float32 attention with its log-sum-exp, on any device (the fallback and
    the reference). Causal is lower-right: query ``i`` of ``n`` over ``N`` keys sees
    keys ``0..N-n+i``."""
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, 1) if group > 1 else k.float()
    v32 = v.float().repeat_interleave(group, 1) if group > 1 else v.float()
    rows, keys = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for i0 in range(0, rows, QUERY_CHUNK):
        i1 = min(rows, i0 + QUERY_CHUNK)
        s = torch.matmul(q[:, :, i0:i1].float(), k32.transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.float()
        if causal:
            row = torch.arange(i0, i1, device=q.device)[:, None] + (keys - rows)
            s = s.masked_fill(torch.arange(keys, device=q.device)[None, :] > row, float("-inf"))
        lse = torch.logsumexp(s, -1)
        # A fully masked row has lse -inf: output 0 (and lse -inf) rather than NaN.
        shift = lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)
        outs.append(torch.matmul(torch.exp(s - shift), v32))
        lses.append(lse)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    bias: torch.Tensor | None = None,
) -> Partial:
    """Attention of ``q`` ``[b, Hq, rows, D]`` over ``k``/``v`` ``[b, Hkv, keys, D]``
    (``Hq`` a multiple of ``Hkv``), with an additive ``bias`` broadcastable to
    ``[b, Hq, rows, keys]``; returns the output and its log-sum-exp."""
    if _use_flash(q):
        return _flash_partial(q, k, v, causal, bias)
    return _math_partial(q, k, v, causal, bias)


def merge(parts: list[Partial]) -> torch.Tensor:
    """Combine partial attentions over disjoint key sets into the full attention
    (float32). Every row needs at least one part with a finite log-sum-exp."""
    return combine(parts)[0]


def combine(parts: list[Partial]) -> Partial:
    """:func:`merge`, keeping the combined log-sum-exp (float32 output)."""
    out, lse = parts[0][0].float(), parts[0][1]
    for o, part_lse in parts[1:]:
        # NOTE: two parts weigh sigmoid(lse_a - lse_b) and its complement: 4 small ops a
        # merge instead of 9 for stack/logsumexp/exp, a quarter of the time. A row with
        # no keys in either part so far (both -inf) gives NaN; it weighs 0.5 of two
        # zero outputs instead, and a later part with keys takes it over.
        w = torch.sigmoid(lse - part_lse).nan_to_num_(0.5).unsqueeze(-1)
        out = torch.lerp(o.float(), out, w)
        lse = torch.logaddexp(lse, part_lse)
    return out, lse


def _fold(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[rows, H, D]`` queries as ``[1, kv_heads, rows * group, D]``.

    NOTE: every query head of a GQA group reads the same K/V head, so the group's heads
    become extra query rows of one KV head: the kernel then streams each K/V head once
    instead of once per query head; on the CPU that is several times faster at decode
    (bench/RESULTS.md, "Where the engine's CPU thresholds come from").
    """
    rows, heads, dim = q.shape
    group = heads // kv_heads
    if rows == 1:  # a lone decode row: the heads already are in group order
        return q.reshape(1, kv_heads, group, dim)
    return q.reshape(rows, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)


def _unfold(part: Partial, rows: int) -> Partial:
    """A folded partial back as ``[rows, H, D]`` and ``[rows, H]``."""
    out, lse = part
    kv_heads, dim = out.shape[1], out.shape[-1]
    if rows == 1:
        return out.reshape(1, -1, dim), lse.reshape(1, -1)
    out = out.reshape(kv_heads, rows, -1, dim).transpose(0, 1).reshape(rows, -1, dim)
    lse = lse.reshape(kv_heads, rows, -1).transpose(0, 1).reshape(rows, -1)
    return out, lse


def _prefill(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, span: PrefillSpan
) -> torch.Tensor:
    """``[n, H, D]`` attention of one prefill's rows (``k``/``v`` its new tokens')."""
    if span.block_ids is not None and cpu_kernels.paged_prefill_supported(q, pool.shape.dtype):
        # One call over the whole context through the block table: the new tokens' K/V
        # were written to the pool above, and are read back from it like the cache. A
        # cold prefill too: at the head sizes it takes, it beats torch's flash kernel
        # (bench/RESULTS.md, "the cold prefill caught up", part 2).
        k_cache, v_cache = pool.head_major(layer)
        scale = q.shape[-1] ** -0.5
        return cpu_kernels.paged_prefill(
            q, k_cache, v_cache, span.block_ids, span.num_cached, scale
        )[0]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if span.num_cached == 0:
        res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        return res[0].transpose(0, 1)
    rows, kv_heads = q.shape[0], k.shape[1]
    own = partial_attention(qs, ks, vs, causal=True)
    parts = [(own[0][0].transpose(0, 1), own[1][0].transpose(0, 1))]
    qf = _fold(q, kv_heads)
    for seg in span.segments:
        ck, cv = pool.segment(layer, seg.block, seg.tokens)
        parts.append(_unfold(partial_attention(qf, ck.unsqueeze(0), cv.unsqueeze(0)), rows))
    if span.gathered is not None:
        ck, cv = pool.gather_blocks(layer, span.gathered)
        parts.append(_unfold(partial_attention(qf, ck.unsqueeze(0), cv.unsqueeze(0)), rows))
    return merge(parts)


def _lane_parts(layer: int, q: torch.Tensor, pool: KVPool, span: DecodeSpan) -> Partial:
    """The lanes' private long runs, read in place, as one ``[batch, H, D]`` partial.

    Lanes with no long private run contribute nothing here: weight exp(-inf) = 0.
    """
    batch, heads, dim = q.shape
    kv_heads = pool.shape.num_kv_heads
    per_lane: dict[int, list[Partial]] = {}
    for lane, seg in span.lane_segments:
        ck, cv = pool.segment(layer, seg.block, seg.tokens)
        qf = _fold(q[lane : lane + 1], kv_heads)
        part = _unfold(partial_attention(qf, ck[None], cv[None], bias=seg.bias), 1)
        per_lane.setdefault(lane, []).append(part)
    lane_out = q.new_zeros(batch, heads, dim, dtype=torch.float32)
    lane_lse = q.new_full((batch, heads), float("-inf"), dtype=torch.float32)
    for lane, lane_parts in per_lane.items():
        out, lse = combine(lane_parts)
        lane_out[lane], lane_lse[lane] = out[0], lse[0]
    return lane_out, lane_lse


def _decode(layer: int, q: torch.Tensor, pool: KVPool, span: DecodeSpan) -> torch.Tensor:
    """``[batch, H, D]`` attention of the decode rows (their K/V already in the pool)."""
    batch, heads, dim = q.shape
    kv_heads = pool.shape.num_kv_heads
    parts: list[Partial] = []
    if span.shared:
        qf = _fold(q, kv_heads)
        for seg in span.shared:
            ck, cv = pool.segment(layer, seg.block, seg.tokens)
            parts.append(_unfold(partial_attention(qf, ck.unsqueeze(0), cv.unsqueeze(0)), batch))
    if span.tables is not None:
        assert span.lengths is not None
        k_cache, v_cache = pool.head_major(layer)
        own = cpu_kernels.paged_decode(
            q, k_cache, v_cache, span.tables, span.lengths, span.key_start, dim**-0.5
        )
        if not parts:
            return own[0]
        parts.append(own)
    if span.lane_segments:
        if batch == 1:
            # A lone sequence: its runs are plain parts, no per-lane bookkeeping.
            for _, seg in span.lane_segments:
                ck, cv = pool.segment(layer, seg.block, seg.tokens)
                qf = _fold(q, kv_heads)
                parts.append(_unfold(partial_attention(qf, ck[None], cv[None], bias=seg.bias), 1))
        else:
            parts.append(_lane_parts(layer, q, pool, span))
    if span.rest is not None:
        ck, cv = pool.gather_blocks(layer, span.rest)  # [batch, Hkv, P * bs, D]
        q4 = q.reshape(batch, kv_heads, heads // kv_heads, dim)  # the group as query rows
        o, lse = partial_attention(q4, ck, cv, bias=span.rest_bias)
        lse = lse.reshape(batch, heads)
        if span.rest_empty is not None:
            # NOTE: the CPU kernel reports a fully masked row as output 0 with a
            # log-sum-exp of 0, not -inf; such a lane must weigh nothing in the merge.
            lse = lse.masked_fill(span.rest_empty[:, None], float("-inf"))
        parts.append((o.reshape(batch, heads, dim), lse))
    return merge(parts)


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: KVPool,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write ``k``/``v`` for the packed rows, then attend; returns ``[tokens, q_heads, D]``.

    NOTE: prefills run per sequence (a Python loop over sequences, not tokens): their
    lengths differ wildly (one 8k prompt next to a 20-token one), and padding them to
    one rectangle would waste more than the per-call overhead costs.
    """
    pool.write(layer, meta.slot_mapping, k, v)
    if meta.varlen is not None:
        vm = meta.varlen
        k_cache, v_cache = pool.head_major(layer)
        return cuda_paged_attention(
            q, k_cache, v_cache, vm.cu_seqlens_q, vm.seq_lens, vm.block_tables, vm.max_q, vm.max_k
        )
    if pool.shape.dtype != q.dtype:
        k, v = k.to(pool.shape.dtype).to(q.dtype), v.to(pool.shape.dtype).to(q.dtype)
    if not meta.prefills and meta.decode is not None:
        return _decode(layer, q, pool, meta.decode).to(q.dtype)  # a decode-only step
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.start, span.end)
        out[rows] = _prefill(layer, q[rows], k[rows], v[rows], pool, span)
    if meta.decode is not None:
        out[meta.decode.start :] = _decode(layer, q[meta.decode.start :], pool, meta.decode)
    return out
