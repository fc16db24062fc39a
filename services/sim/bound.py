"""The infinite-cache bound: what a cache that never forgets could serve, from the trace alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachepoint.sim.content import PreparedRequest
from cachepoint.sim.trace import Trace


@dataclass(frozen=True, slots=True)
class CacheBound:
    """Share of prefix blocks (and tokens) whose whole prefix appeared in an earlier request."""

    blocks: int  # trace blocks over all prompts (the last, partial one included)
    blocks_seen: int  # of those, with the same prefix in an earlier request
    tokens: int  # prompt tokens over all requests
    tokens_seen: int  # tokens in blocks_seen
    distinct_blocks: int  # distinct prefix blocks: what an infinite cache would hold

    @property
    def block_bound(self) -> float:
        return self.blocks_seen / self.blocks if self.blocks else 0.0

    @property
    def token_bound(self) -> float:
        return self.tokens_seen / self.tokens if self.tokens else 0.0


def infinite_cache_bound(trace: Trace, prepared: Sequence[PreparedRequest]) -> CacheBound:
    """Walk the requests in arrival order and count the blocks seen before.

    NOTE: this is the bound the Mooncake paper's traces are quoted against (36.6 %
    of the conversation trace's blocks). A real replica never hits the block that
    holds the last prompt token, nor a partial block, so a cache can come short of
    it by those (0.1 % of blocks on that trace).
    """
    seen: set[int] = set()
    blocks = blocks_seen = tokens = tokens_seen = 0
    bt = trace.block_tokens
    for req, prep in zip(trace.requests, prepared, strict=True):
        left = req.input_length
        for node in prep.nodes:
            size = min(left, bt)
            left -= size
            if node in seen:
                blocks_seen += 1
                tokens_seen += size
            else:
                seen.add(node)
        blocks += len(prep.nodes)
        tokens += req.input_length
    return CacheBound(blocks, blocks_seen, tokens, tokens_seen, len(seen))


@dataclass(frozen=True, slots=True)
class ReuseProfile:
    """How a trace reuses its blocks: what any eviction policy has to predict."""

    distinct_blocks: int  # distinct prefix blocks
    used_once: int  # of those, used by one request only
    reuse_given_uses: tuple[float, ...]  # P(used again | used k times), k = 1, 2, ...
    max_live_blocks: int  # most blocks at once that some later request will use again
    gap_quantiles_s: tuple[tuple[float, float], ...]  # (q, seconds between two uses of a block)


def reuse_profile(
    trace: Trace, prepared: Sequence[PreparedRequest], max_uses: int = 5
) -> ReuseProfile:
    """Reuse statistics of the trace's prefix blocks (nodes), from the trace alone."""
    uses: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for i, prep in enumerate(prepared):
        for node in prep.nodes:
            uses[node] = uses.get(node, 0) + 1
            last_use[node] = i
    live: set[int] = set()
    max_live = 0
    last_seen: dict[int, float] = {}
    gaps: list[float] = []
    for i, (req, prep) in enumerate(zip(trace.requests, prepared, strict=True)):
        for node in prep.nodes:
            if node in last_seen:
                gaps.append(req.arrival_s - last_seen[node])
            last_seen[node] = req.arrival_s
            if last_use[node] > i:
                live.add(node)
            else:
                live.discard(node)
        max_live = max(max_live, len(live))
    at_least = [sum(1 for n in uses.values() if n >= k) for k in range(1, max_uses + 2)]
    cond = tuple(
        at_least[k] / at_least[k - 1] if at_least[k - 1] else 0.0 for k in range(1, max_uses + 1)
    )
    gaps.sort()
    quantiles = tuple(
        (q, gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else 0.0)
        for q in (0.5, 0.75, 0.9, 0.99)
    )
    used_once = sum(1 for n in uses.values() if n == 1)
    return ReuseProfile(len(uses), used_once, cond, max_live, quantiles)
