"""The cache plan of a rendered prompt with neutral contract settings (shared by the
render tests): one org, no betas, the default scope policy, nothing too short."""

from __future__ import annotations

from typing import Any

from cachepoint.gateway.contract.breakpoints import CachePlan, ScopePolicy, resolve
from cachepoint.gateway.contract.prompt import RenderedPrompt


def plan_of(rendered: RenderedPrompt, block_size: int = 16) -> CachePlan:
    return resolve(
        rendered,
        None,
        model="m",
        tenant_key="org:1",
        betas=(),
        cache_key_betas=(),
        policy=ScopePolicy(),
        min_cacheable_tokens=0,
        block_size=block_size,
    )


def last_breakpoint(renderer: Any, request: Any) -> tuple[RenderedPrompt, int]:
    """The rendering of ``request`` and the position of its last breakpoint."""
    out = renderer.render(request)
    return out, max(b.position for b in plan_of(out).breakpoints)
