"""`cachepoint demo`: a narrated walk through kvcore, on a simulated clock."""

from __future__ import annotations

from cachepoint.kvcore import (
    TTL_5M,
    BlockPool,
    KeySpan,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    PrefixIndex,
    entry_key_at,
    hash_blocks,
)


def _line(step: str, detail: str) -> None:
    print(f"  {step:<34} {detail}")


def run_demo(num_blocks: int = 64, block_size: int = 16) -> int:
    clock = ManualClock(0.0)
    pool = BlockPool(num_blocks, block_size, retained_share=0.5, clock=clock)
    mgr = KVCacheManager(pool)
    router_view = PrefixIndex()
    model = "demo-model"

    system = list(range(1, 1 + 8 * block_size))  # a static system prompt: 8 blocks
    turn = [7000 + i for i in range(2 * block_size + 5)]  # a user turn: 2 blocks + 5
    prompt = system + turn
    org_a = [KeySpan(0, (model, "scope:global")), KeySpan(8, (model, "org:a"))]
    hs = hash_blocks(prompt, block_size, org_a)

    print(f"kvcore demo: {num_blocks} blocks x {block_size} tokens, retained share 50%")
    print("1. org A sends a prompt; a breakpoint (5m) sits at its end")
    with mgr.allocate(hs, len(prompt)) as a:
        _line("prefix hit", f"{a.num_cached_tokens} tokens (cold)")
        _line("prefill computes", f"{len(prompt) - a.num_cached_tokens} tokens")
        _line("commit publishes", f"{a.commit()} blocks")
        key = entry_key_at(prompt, len(prompt), hs, block_size, (model, "org:a"))
        w = mgr.write_entry(key, len(prompt), hs, TTL_5M)
        _line("cache entry written", f"{w.written}, expires at t={w.expires_at:.0f}s")
    router_view.apply_all(mgr.take_events())
    _line("router index now holds", f"{len(router_view)} block hashes")

    print("2. org A returns 4 minutes later with the same prefix")
    clock.advance(240)
    hit = mgr.lookup_entry([key])
    assert hit is not None
    _line("managed entry hit", f"{hit.num_tokens} tokens billed as cache read")
    _line("TTL refreshed to", f"t={hit.expires_at:.0f}s")
    with mgr.allocate(hs, len(prompt)) as a:
        _line("engine reuses", f"{a.num_cached_tokens} tokens of KV (full blocks)")
        _line("prefill computes", f"{len(prompt) - a.num_cached_tokens} tokens")
        a.commit()
    _line("router predicts", f"{router_view.match(hs) * block_size} tokens on this replica")

    print("3. org B sends the same text: the global system prefix is shared, the rest is not")
    org_b = [KeySpan(0, (model, "scope:global")), KeySpan(8, (model, "org:b"))]
    hb = hash_blocks(prompt, block_size, org_b)
    _line("org B prefix match", f"{mgr.match(hb, len(prompt)).num_tokens} tokens (system only)")

    print("4. pressure: unrelated traffic fills the pool; retained blocks survive")
    for i in range(num_blocks):
        other = [50_000 + i * 1000 + t for t in range(3 * block_size)]
        try:
            with mgr.allocate(hash_blocks(other, block_size), len(other)) as o:
                o.commit()
        except PoolExhaustedError:
            break
    stats = mgr.stats()
    _line("evictions so far", f"{stats.evictions}")
    _line("org A prefix still cached", f"{mgr.match(hs, len(prompt)).num_tokens} tokens")

    print("5. the entry expires 5 minutes after its last hit")
    clock.advance(TTL_5M + 1)
    _line("entry lookup", "miss" if mgr.lookup_entry([key]) is None else "hit")
    stats = mgr.stats()
    b = stats.blocks
    _line(
        "blocks",
        f"active={b.active} cached_free={b.cached_free} empty={b.empty} retained={b.retained}",
    )
    _line("hit rate (tokens)", f"{stats.hit_tokens}/{stats.query_tokens}")
    return 0
