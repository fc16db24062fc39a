"""Resolve `cache_control` markers into breakpoints, scope and cache keys (contract §3)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from cachepoint.gateway.contract.prompt import BlockSpan, RenderedPrompt
from cachepoint.gateway.schemas.messages import CacheControl
from cachepoint.kvcore import MAX_LOOKBACK_BOUNDARIES
from cachepoint.kvcore.limits import MAX_BREAKPOINTS

SCOPE_BETA = "prompt-caching-scope-2026-01-05"

Scope = Literal["org", "global"]


class ContractError(ValueError):
    """A request that breaks the cache_control contract: a 400 naming the path."""


@dataclass(frozen=True, slots=True)
class ScopePolicy:
    """An org's say over global scope; shared prefixes leak through timing."""

    allow_global: bool = False  # opt-in per org
    allowlist: frozenset[str] = frozenset()  # prefix digests global may cover; empty = any


@dataclass(frozen=True, slots=True)
class Breakpoint:
    path: str  # where the marker sits in the request
    position: int  # prefix length in tokens
    ttl: Literal["5m", "1h", "24h"]  # 24h: OpenAI's prompt_cache_retention only
    scope: Scope  # the scope actually used
    extra_keys: tuple[str, ...]  # the keys its entry is written under
    boundaries: tuple[int, ...]  # earlier block ends to look back on, nearest first


@dataclass(frozen=True, slots=True)
class CachePlan:
    breakpoints: tuple[Breakpoint, ...]  # sent to the replica (>= min cacheable)
    key_spans: tuple[tuple[int, tuple[str, ...]], ...]  # (start_block, extra keys)
    scope: Scope  # "global" when a global marker was honoured
    requested_global: bool = False  # a marker asked for global scope
    dropped_below_minimum: tuple[str, ...] = field(default=())  # paths too short to cache


def prefix_digest(tokens: Sequence[int]) -> str:
    """Identifies a global prefix for an org's allow-list (hex sha256 of int32 tokens)."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(int(t).to_bytes(4, "little", signed=True))
    return h.hexdigest()


def _markers(
    rendered: RenderedPrompt, automatic: CacheControl | None
) -> list[tuple[BlockSpan, CacheControl]]:
    out: list[tuple[BlockSpan, CacheControl]] = []
    for span in rendered.blocks:
        if span.cache_control is None:
            continue
        if not span.cacheable:
            what = "empty text blocks" if span.kind == "text" else f"{span.kind} blocks"
            raise ContractError(f"{span.path}.cache_control: cache_control cannot be set on {what}")
        out.append((span, span.cache_control))
    if automatic is not None:
        last = next((s for s in reversed(rendered.blocks) if s.cacheable), None)
        if last is not None and all(s is not last for s, _ in out):
            out.append((last, automatic))
            out.sort(key=lambda m: m[0].start)
    return out


def resolve(
    rendered: RenderedPrompt,
    automatic: CacheControl | None,
    *,
    model: str,
    tenant_key: str,
    betas: Collection[str],
    cache_key_betas: Collection[str],
    policy: ScopePolicy,
    min_cacheable_tokens: int,
    block_size: int,
) -> CachePlan:
    markers = _markers(rendered, automatic)
    if len(markers) > MAX_BREAKPOINTS:
        raise ContractError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(markers)}."
        )
    seen_5m = False
    for span, cc in markers:
        ttl = cc.ttl or "5m"
        if ttl == "1h" and seen_5m:
            raise ContractError(
                f"{span.path}.cache_control: a ttl='1h' cache_control block must not come "
                "after a ttl='5m' cache_control block"
            )
        seen_5m = seen_5m or ttl == "5m"

    # Cache-affecting betas become part of every key: another beta set, another cache.
    beta_keys = tuple(sorted(f"beta:{b}" for b in set(betas) & set(cache_key_betas)))
    org_keys = (f"model:{model}", tenant_key, *beta_keys)
    global_keys = (f"model:{model}", "scope:global", *beta_keys)

    requested_global = any(cc.scope == "global" for _, cc in markers)
    global_end = 0
    if requested_global and SCOPE_BETA in betas and policy.allow_global:
        for span, cc in markers:
            # Everything before a global marker must be the same for every tenant:
            # tools and system text only (the render order guarantees what precedes).
            if cc.scope == "global" and span.section in ("tools", "system"):
                if policy.allowlist:
                    digest = prefix_digest(rendered.tokens[: span.end])
                    if digest not in policy.allowlist:
                        continue
                global_end = max(global_end, span.end)

    ends = [s.end for s in rendered.blocks]
    bps: list[Breakpoint] = []
    dropped: list[str] = []
    for span, cc in markers:
        if span.end < min_cacheable_tokens:
            dropped.append(span.path)
            continue
        is_global = cc.scope == "global" and 0 < span.end <= global_end
        earlier = [e for e in ends if e < span.end]
        earlier.reverse()
        bps.append(
            Breakpoint(
                path=span.path,
                position=span.end,
                ttl=cc.ttl or "5m",
                scope="global" if is_global else "org",
                extra_keys=global_keys if is_global else org_keys,
                boundaries=tuple(earlier[: MAX_LOOKBACK_BOUNDARIES - 1]),
            )
        )
    # NOTE: global covers only the full blocks that end at or before the last global
    # marker; the block that straddles it is org-keyed and chains onto the global run.
    global_blocks = global_end // block_size if any(b.scope == "global" for b in bps) else 0
    if global_blocks:
        spans: tuple[tuple[int, tuple[str, ...]], ...] = (
            (0, global_keys),
            (global_blocks, org_keys),
        )
    else:
        spans = ((0, org_keys),)
    return CachePlan(
        breakpoints=tuple(bps),
        key_spans=spans,
        scope="global" if global_blocks or any(b.scope == "global" for b in bps) else "org",
        requested_global=requested_global,
        dropped_below_minimum=tuple(dropped),
    )
