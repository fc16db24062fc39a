"""Shared drivers for the eviction tests: prompts, one served request, random pool ops."""

from __future__ import annotations

from cachepoint.kvcore import BlockPool, KVCacheManager, PoolExhaustedError, hash_blocks
from cachepoint.kvcore.allocation import Allocation
from cachepoint.kvcore.clock import ManualClock

BLOCK = 2  # tokens per block: small, so a few tokens make a chain


def prompt(tag: int, blocks: int) -> list[int]:
    """``blocks`` full blocks of tokens; prompts with different tags share nothing."""
    return [tag * 1000 + i for i in range(blocks * BLOCK)]


def serve(mgr: KVCacheManager, tokens: list[int]) -> int:
    """Allocate, commit and free one prompt; returns the tokens it hit."""
    hs = hash_blocks(tokens, BLOCK)
    alloc = mgr.allocate(hs, len(tokens) + 1)  # one more token: every full block may hit
    alloc.commit()
    alloc.free()
    return alloc.num_cached_tokens


def apply_pool_op(
    op: str,
    arg: int,
    pool: BlockPool,
    mgr: KVCacheManager,
    clock: ManualClock,
    held: list[Allocation],
    *,
    tick_s: float = 1.0,
    expire_on_tick: bool = True,
) -> None:
    """One step of a random workload: serve, hold or release a request, retain its
    prefix, let time pass (``arg * tick_s`` seconds), or clear the pool."""
    tokens = prompt(arg % 3, 1 + arg % 4)
    hs = hash_blocks(tokens, BLOCK)
    if op in ("serve", "hold"):
        try:
            alloc = mgr.allocate(hs, len(tokens))
        except PoolExhaustedError:
            return
        alloc.commit()
        if op == "serve":
            alloc.free()
        else:
            held.append(alloc)
    elif op == "release" and held:
        held.pop(arg % len(held)).free()
    elif op == "retain":
        blocks = pool.match_prefix(hs, len(hs))
        if blocks:
            pool.retain(blocks, 5.0)
    elif op == "tick":
        clock.advance(arg * tick_s)
        if expire_on_tick:
            pool.expire()
    elif op == "clear":
        mgr.clear()
