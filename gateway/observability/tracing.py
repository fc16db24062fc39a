"""Span attributes the gateway sets: GenAI semantic conventions where they exist,
``cachepoint.*`` for the rest."""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue

from cachepoint.billing import Buckets
from cachepoint.gateway.contract.breakpoints import CachePlan
from cachepoint.gateway.contract.prompt import RenderedPrompt


def usage_attributes(b: Buckets, cost_micros: int | None = None) -> dict[str, AttributeValue]:
    """NOTE: per the GenAI conventions gen_ai.usage.input_tokens includes cached
    tokens; the Anthropic-style uncached count is cachepoint.usage.input_tokens."""
    attrs: dict[str, AttributeValue] = {
        "gen_ai.usage.input_tokens": b.prompt_tokens,
        "gen_ai.usage.output_tokens": b.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": b.cache_read_input_tokens,
        "gen_ai.usage.cache_creation.input_tokens": b.cache_creation_input_tokens,
        "cachepoint.usage.input_tokens": b.input_tokens,
        "cachepoint.usage.cache_creation.ephemeral_5m_input_tokens": b.cache_write_5m_tokens,
        "cachepoint.usage.cache_creation.ephemeral_1h_input_tokens": b.cache_write_1h_tokens,
    }
    if cost_micros is not None:
        attrs["cachepoint.cost_usd"] = cost_micros / 1_000_000
    return attrs


def render_attributes(rendered: RenderedPrompt, plan: CachePlan) -> dict[str, AttributeValue]:
    return {
        "cachepoint.render.tokens": len(rendered),
        "cachepoint.render.blocks": len(rendered.blocks),
        "cachepoint.render.breakpoints": [bp.position for bp in plan.breakpoints],
        "cachepoint.cache.scope": plan.scope,
    }
