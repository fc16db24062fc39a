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

from .kv_pool import KVPool


@dataclass(slots=True)
class PrefillSpan:
    """One prefilling sequence's rows in the packed batch."""

    start: int  # first packed row (its token is at position num_cached)
    end: int  # one past the last packed row
    length: int  # N: the context attended over, positions 0..N-1
    block_table: torch.Tensor  # [ceil(N / block_size)] blocks holding positions 0..N-1
    # [end-start, N] bool, True = may attend; None when nothing was cached, where the
    # plain causal mask applies and SDPA can skip the masked half.
    mask: torch.Tensor | None


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


def causal_mask_with_prefix(num_cached: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[N-M, N]`` mask: query ``i`` (position ``M+i``) sees keys ``0..M+i``."""
    keys = torch.arange(num_tokens, device=device)
    queries = torch.arange(num_cached, num_tokens, device=device)
    return keys[None, :] <= queries[:, None]


# NOTE: with an explicit mask SDPA computes every (query, key) pair, masked or not; in
# query chunks, each chunk stops at its own last key, so only a chunk-sized triangle
# per chunk is wasted instead of half of the new tokens' square.
QUERY_CHUNK = 1024


def _prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Causal attention of ``n`` queries that follow a cached prefix: ``[1, H, n, D]``."""
    n, total = mask.shape
    if n <= QUERY_CHUNK:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = torch.empty_like(q)
    for i0 in range(0, n, QUERY_CHUNK):
        i1 = min(n, i0 + QUERY_CHUNK)
        keys = total - n + i1  # the chunk's last query sees keys 0..keys-1
        out[:, :, i0:i1] = F.scaled_dot_product_attention(
            q[:, :, i0:i1],
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=mask[i0:i1, :keys],
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
        if span.mask is None:
            res = F.scaled_dot_product_attention(qs, ck, cv, is_causal=True, enable_gqa=True)
        else:
            res = _prefix_attention(qs, ck, cv, span.mask)
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
