"""Prefill attention, kernel for kernel: our CPU kernel (``paged_prefill``) against
torch's path for the same rows, cold and over a cached prefix, one layer.

torch's path is what the engine runs without the kernel: a cold prefill is one
``scaled_dot_product_attention(is_causal=True)`` (torch's CPU flash kernel); a cached
one is the new tokens' causal attention plus the cached keys' (GQA heads folded into
rows), merged by log-sum-exp. The kernel reads every key through a block table from
a head-major pool, as in the engine. Each figure is the best of --repeats, after one
untimed call; outputs are compared (they must agree to float32 rounding).

    .venv/bin/python bench/attention_bench.py               # SmolLM2's heads and more
    .venv/bin/python bench/attention_bench.py --threads 2 --repeats 9

Needs the CPU kernel (Linux, AVX-512; built by `make install`). Exits 0 whatever the
figures; 2 where the kernel cannot run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cachepoint.engine import cpu_kernels
from cachepoint.engine.attention import _fold, _unfold, merge, partial_attention

# (query heads, KV heads, head_dim): SmolLM2-135M's first, then smaller and larger.
HEADS = [(9, 3, 64), (8, 2, 32), (4, 4, 16), (32, 8, 128)]
# (new tokens, cached tokens): AIPerf's cold first turn, its later turns, a long
# context, a short turn, a full 2,048-token chunk.
SHAPES = [(1814, 0), (300, 1824), (512, 4096), (64, 2000), (2048, 0)]
BLOCK = 16


def best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def case(heads: int, kv_heads: int, dim: int, new: int, cached: int, repeats: int) -> str:
    total = new + cached
    blocks = -(-total // BLOCK)
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(new, heads, dim, generator=gen)
    k_all = torch.randn(total, kv_heads, dim, generator=gen)
    v_all = torch.randn(total, kv_heads, dim, generator=gen)
    # the pool: head-major [kv_heads, blocks, BLOCK, dim], blocks in a shuffled order
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    k_cache = torch.zeros(kv_heads, blocks, BLOCK, dim)
    v_cache = torch.zeros(kv_heads, blocks, BLOCK, dim)
    slots = torch.arange(total)
    where = table.long()[slots // BLOCK], slots % BLOCK
    k_cache[:, where[0], where[1]] = k_all.transpose(0, 1)
    v_cache[:, where[0], where[1]] = v_all.transpose(0, 1)
    k, v = k_all[cached:], v_all[cached:]
    scale = dim**-0.5

    def torchs() -> torch.Tensor:
        qs = q.transpose(0, 1)[None]
        ks, vs = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if cached == 0:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)
        own = partial_attention(qs, ks, vs, causal=True)
        parts = [(own[0][0].transpose(0, 1), own[1][0].transpose(0, 1))]
        ck = k_all[:cached].transpose(0, 1)[None]
        cv = v_all[:cached].transpose(0, 1)[None]
        parts.append(_unfold(partial_attention(_fold(q, kv_heads), ck, cv), new))
        return merge(parts)

    def ours() -> torch.Tensor:
        return cpu_kernels.paged_prefill(q, k_cache, v_cache, table, cached, scale)[0]

    with torch.inference_mode():
        diff = (torchs().float() - ours()).abs().max().item()
        a, b = best_ms(torchs, repeats), best_ms(ours, repeats)
    return (
        f"| {heads}/{kv_heads} | {dim} | {new} | {cached} | {a:.2f} | {b:.2f} | "
        f"{b / a:.2f}x | {diff:.1e} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls, best of (5)")
    args = p.parse_args(argv)
    if not cpu_kernels.load():
        print(f"attention_bench: the CPU kernel cannot run: {cpu_kernels.why_unavailable()}")
        return 2
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads} block={BLOCK} best of {args.repeats}, one layer, float32")
    print(
        "| heads (q/kv) | head_dim | new | cached | torch ms | kernel ms | kernel/torch "
        "| max diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for heads, kv_heads, dim in HEADS:
        for new, cached in SHAPES:
            print(case(heads, kv_heads, dim, new, cached, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
