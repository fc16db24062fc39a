"""The rate limits as routes apply them: admit the request against its org's and key's
buckets, and add the API's headers to the response (Anthropic's
``anthropic-ratelimit-*`` on the Messages API, OpenAI's ``x-ratelimit-*`` on its
endpoints; ``retry-after`` too when refused, with a 429). The generation routes call
``admit`` and ``admit_openai`` from their one dependency (``calls.py``); count_tokens
depends on ``admit_count``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from cachepoint.gateway.api.deps import MessageCallerDep, StateDep
from cachepoint.gateway.api.middleware import extra_headers
from cachepoint.gateway.errors import rate_limited
from cachepoint.gateway.observability import requestlog
from cachepoint.gateway.tenancy.ratelimit import Admission


async def admit(request: Request, state: StateDep, ctx: MessageCallerDep) -> Admission:
    # NOTE: on the loop on purpose: no I/O here, and a worker thread would cost a hop
    # per request and touch the buckets from several threads.
    requestlog.note_caller(ctx)
    admission = state.limiter.admit(ctx.org_id, ctx.key_id)
    extra_headers(request.scope).extend(admission.headers())
    if not admission.allowed:
        raise rate_limited(
            f"This request would exceed your rate limit of {admission.reason} "
            f"(per gateway); retry after the retry-after header's seconds"
        )
    return admission


async def admit_openai(request: Request, state: StateDep, ctx: MessageCallerDep) -> Admission:
    """`admit` for the OpenAI-compatible endpoints: the same buckets, OpenAI's
    ``x-ratelimit-*`` headers (the 429 leaves in OpenAI's envelope: errors.py)."""
    requestlog.note_caller(ctx)
    admission = state.limiter.admit(ctx.org_id, ctx.key_id)
    extra_headers(request.scope).extend(admission.openai_headers())
    if not admission.allowed:
        raise rate_limited(
            f"Rate limit reached for {admission.reason} (per gateway); retry after the "
            "retry-after header's seconds"
        )
    return admission


async def admit_count(request: Request, state: StateDep, ctx: MessageCallerDep) -> Admission:
    """count_tokens' own per-org budget (ratelimit.RateLimiter.admit_count), with the
    same headers and 429 as messages."""
    requestlog.note_caller(ctx)
    admission = state.limiter.admit_count(ctx.org_id)
    extra_headers(request.scope).extend(admission.headers())
    if not admission.allowed:
        state.metrics.count_tokens.labels("rate_limited").inc()
        raise rate_limited(
            f"This request would exceed your rate limit of {admission.reason} "
            f"(per gateway); retry after the retry-after header's seconds"
        )
    return admission


CountLimitDep = Annotated[Admission, Depends(admit_count)]
