"""kvcore micro-benchmarks: hashing, prefix lookup, allocate/commit/free.

Run:  .venv/bin/python bench/kvcore_bench.py [--tokens 131072] [--repeat 7]

Every figure is the best of ``--repeat`` runs, measured side by side in one process.
The hashing baseline is vLLM's default scheme: SHA-256 over a pickle of
``(parent, tuple(block_tokens), extra_keys)`` for each block.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import platform
import random
import time
from array import array
from collections.abc import Callable

from cachepoint.kvcore import BlockPool, KVCacheManager, PrefixIndex, hash_blocks

EXTRA = ("model:demo", "org:bench")


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def vllm_sha256_pickle(tokens: list[int], block_size: int) -> list[bytes]:
    parent = b"\0" * 32
    out = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(
            pickle.dumps((parent, block, EXTRA), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        out.append(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131_072, help="prompt length (default 131072)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--repeat", type=int, default=7, help="runs per figure; best is kept")
    args = ap.parse_args()
    n, bs, rep = args.tokens, args.block_size, args.repeat
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(n)]
    tokens_i32 = array("i", tokens)

    print(f"kvcore bench: {n} tokens, block_size {bs}, best of {rep}")
    print(f"python {platform.python_version()} on {platform.machine()}")
    print()

    t_base = best_of(lambda: vllm_sha256_pickle(tokens, bs), rep)
    t_list = best_of(lambda: hash_blocks(tokens, bs, EXTRA), rep)
    t_arr = best_of(lambda: hash_blocks(tokens_i32, bs, EXTRA), rep)
    print("hashing (chained, every full block)")
    print(
        f"  baseline sha256+pickle (list)  {n / t_base / 1e6:8.2f} M tok/s  {t_base * 1e3:7.2f} ms"
    )
    print(
        f"  kvcore xxh3-128, int32 array   {n / t_arr / 1e6:8.2f} M tok/s  {t_arr * 1e3:7.2f} ms"
        f"  x{t_base / t_arr:.1f} vs baseline"
    )
    print(
        f"  kvcore xxh3-128, list[int]     {n / t_list / 1e6:8.2f} M tok/s  {t_list * 1e3:7.2f} ms"
        f"  x{t_base / t_list:.1f} vs baseline (includes list->int32 conversion)"
    )
    print()

    # Prefix lookup with a 90% hit, on a pool and on the router's index.
    hashes = hash_blocks(tokens_i32, bs, EXTRA)
    num_blocks = len(hashes)
    hit_blocks = int(num_blocks * 0.9)
    pool = BlockPool(num_blocks + 16, bs)
    mgr = KVCacheManager(pool)
    alloc = mgr.allocate(hashes[:hit_blocks], hit_blocks * bs)
    alloc.commit()
    alloc.free()
    index = PrefixIndex(hashes[:hit_blocks])
    assert mgr.match(hashes, n).num_blocks == hit_blocks
    assert index.match(hashes) == hit_blocks
    t_pool = best_of(lambda: mgr.match(hashes, n), rep * 3)
    t_index = best_of(lambda: index.match(hashes), rep * 3)
    t_e2e = best_of(lambda: index.match(hash_blocks(tokens_i32, bs, EXTRA)), rep)
    print(f"prefix lookup, {n} tokens, 90% hit ({hit_blocks} of {num_blocks} blocks)")
    print(f"  replica pool (KVCacheManager.match)  {t_pool * 1e6:8.0f} us")
    print(f"  router index (PrefixIndex.match)     {t_index * 1e6:8.0f} us")
    print(f"  router: hash the prompt + match      {t_e2e * 1e6:8.0f} us")
    print()

    # Allocate + commit + free: a churn of 1k-token requests on a pool that must evict.
    pool = BlockPool(4096, bs)
    mgr = KVCacheManager(pool)
    reqs = []
    for r in range(512):
        toks = array("i", [r * 10_000 + t for t in range(1024)])
        reqs.append(hash_blocks(toks, bs))

    def churn() -> int:
        moved = 0
        for hs in reqs:
            a = mgr.allocate(hs, len(hs) * bs + 1)
            a.commit()
            a.free()
            moved += len(a.block_hashes) + 1
        return moved

    per_round = churn()
    t_churn = best_of(churn, rep)
    print("allocate + commit + free (1,024-token requests, 4,096-block pool, evicting)")
    rate = per_round / t_churn / 1e6
    print(f"  {rate:8.3f} M blocks/s  ({per_round} blocks in {t_churn * 1e3:.1f} ms)")
    pool.check_invariants()


if __name__ == "__main__":
    main()
