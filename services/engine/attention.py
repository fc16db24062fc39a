"""Attention over the paged KV pool, for a flat batch of prefill and decode tokens.

A step's tokens are packed into one ``[tokens, ...]`` batch: every prefill's computed
tokens (``M..N-1``) first, then one token per decoding sequence. The linear layers run
on the whole packed batch at once; only attention needs to know where sequences start
and end, and that is what :class:`AttentionMetadata` says.

Each layer first writes the new tokens' K/V into their pool slots, then reads every
sequence's context (cached prefix and new tokens alike) back from the pool. Reading
the new tokens back instead of using them directly costs one small gather, and buys
the property the cache depends on: a cached prefill and a cold prefill attend over
bit-identical K/V, whatever the pool's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .kv_pool import KVPool


@dataclass(slots=True)
class PrefillSpan:
    """One prefilling sequence's rows in the packed batch."""

    start: int  # first packed row (its token is at position num_cached)
    end: int  # one past the last packed row
    length: int  # N: the context attended over, positions 0..N-1
    block_table: torch.Tensor  # [ceil(N / block_size)] blocks holding positions 0..N-1

    @property
    def num_cached(self) -> int:
        """M: the cached positions before the first computed row."""
        return self.length - (self.end - self.start)


@dataclass(slots=True)
class DecodeSpan:
    """All decoding sequences: the last ``batch`` rows of the packed batch."""

    start: int  # first decode row; decode rows run to the end of the batch
    block_table: torch.Tensor  # [batch, nb] blocks of positions 0..nb*block_size-1, padded
    mask: torch.Tensor  # [batch, 1, 1, nb*block_size] bool, True = a position <= the query's


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's packed batch."""

    slot_mapping: torch.Tensor  # [tokens] where each packed row's new K/V is written
    prefills: list[PrefillSpan]  # in packed order
    decode: DecodeSpan | None  # None when the step has no decoding sequences


# NOTE: where causal_lower_right has no fused kernel (off the CPU path below, e.g. a
# float32 CUDA tensor with GQA), SDPA materializes its [n, N] mask; queries in chunks of
# this size bound that mask to [QUERY_CHUNK, N], linear in the context.
QUERY_CHUNK = 1024

# NOTE: private, but the only CPU SDPA entry that returns the log-sum-exp needed to
# merge two partial attentions; absent, the portable lower-right bias is used.
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cpu_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention (GQA native): the output ``[1, H, n, D]`` and its
    natural-log log-sum-exp ``[1, H, n]`` (float32)."""
    assert _CPU_FLASH is not None
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal)[:2]
    return out, lse


def _prefix_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Lower-right causal attention as two mask-free flash calls merged by log-sum-exp.

    NOTE: on the CPU, ``causal_lower_right`` falls back to materializing its ``[n, N]``
    mask, and SDPA then converts that to an ``[n, N]`` float bias. Every query sees the
    whole cached prefix ``0..M-1`` (no mask) and, among the new keys ``M..N-1``, the plain
    causal square (``is_causal`` on an ``n x n`` block is lower-right). Measured on this
    2-core machine, tiny model's shapes (4 heads, 2 KV heads, head_dim 16), one call:
    n=336 over N=6000, 20-34 ms with the chunked explicit mask, 34 ms with
    ``causal_lower_right``, 11-24 ms split; n=1768 over N=32768, 0.7-1.1 s explicit,
    0.38-0.62 s split. A whole tiny-model prefill of 336 tokens over a 5,664-token cached
    prefix: 13.3-14.6 ms before, 9.4-9.8 ms split (best of 10). Peak extra memory is
    two ``[H, n, D]`` partial outputs and their weights; no ``[n, N]`` tensor.
    """
    m = k.shape[2] - q.shape[2]  # > 0: the split relies on a non-empty prefix
    o1, l1 = _cpu_flash(q, k[:, :, :m], v[:, :, :m], causal=False)
    o2, l2 = _cpu_flash(q, k[:, :, m:], v[:, :, m:], causal=True)
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


def _prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``n`` queries that follow a cached prefix: ``[1, H, n, D]``.

    Query ``i`` (position ``N-n+i``) sees keys ``0..N-n+i``: the lower-right causal mask.
    """
    n, total = q.shape[2], k.shape[2]
    if q.device.type == "cpu" and _CPU_FLASH is not None and q.dtype in _CPU_FLASH_DTYPES:
        return _prefix_attention_cpu(q, k, v)
    if n <= QUERY_CHUNK:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(n, total), enable_gqa=True
        )
    out = torch.empty_like(q)
    for i0 in range(0, n, QUERY_CHUNK):
        i1 = min(n, i0 + QUERY_CHUNK)
        keys = total - n + i1  # the chunk's last query sees keys 0..keys-1
        out[:, :, i0:i1] = F.scaled_dot_product_attention(
            q[:, :, i0:i1],
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=causal_lower_right(i1 - i0, keys),
            enable_gqa=True,
        )
    return out


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: KVPool,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write ``k``/``v`` for the packed rows, then attend; returns ``[tokens, q_heads, D]``.

    NOTE: prefills run one SDPA call per sequence (a Python loop over sequences, not
    tokens): their lengths differ wildly (one 8k prompt next to a 20-token one), and
    padding them to one rectangle would waste more than the per-call overhead costs.
    Decodes are one padded, masked SDPA call for the whole batch.
    """
    pool.write(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    for span in meta.prefills:
        ck, cv = pool.gather_blocks(layer, span.block_table)  # [Hkv, nb*bs, D]
        # The last block's tail is not context; [1, Hkv, N, D] is SDPA's layout.
        ck = ck[:, : span.length].to(q.dtype).unsqueeze(0)
        cv = cv[:, : span.length].to(q.dtype).unsqueeze(0)
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
        if span.num_cached == 0:
            res = F.scaled_dot_product_attention(qs, ck, cv, is_causal=True, enable_gqa=True)
        else:
            res = _prefix_attention(qs, ck, cv)
        out[span.start : span.end] = res[0].transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        ck, cv = pool.gather_blocks(layer, d.block_table)  # [B, Hkv, nb*bs, D]
        res = F.scaled_dot_product_attention(
            q[d.start :].unsqueeze(2),  # [B, H, 1, D]
            ck.to(q.dtype),
            cv.to(q.dtype),
            attn_mask=d.mask,
            enable_gqa=True,
        )
        out[d.start :] = res.squeeze(2)
    return out
