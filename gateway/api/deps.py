"""Typed dependencies: the app state, the caller behind the API key, the beta set."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.api.middleware import extra_headers
from cachepoint.gateway.errors import forbidden, invalid, unauthenticated
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy.tenants import KeyContext

# NOTE: any dated version is accepted: SDK releases move the header forward and this
# gateway's wire behaviour does not branch on it; a malformed value is still a 400.
API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")
IGNORED_BETAS_HEADER = "cachepoint-ignored-betas"
# NOTE: Anthropic dates betas as YYYY-MM-DD, except claude-code-20250219 (YYYYMMDD).
DATED_BETA = re.compile(r"^([a-z0-9][a-z0-9-]*?)-(\d{4}-\d{2}-\d{2}|\d{8})$")


# NOTE: every dependency here is async although none awaits: FastAPI runs a plain
# `def` dependency in a worker thread, and five thread hops a request cost more than
# the whole render (bench/RESULTS.md, gateway overhead).
async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def get_caller(request: Request, state: StateDep) -> KeyContext:
    raw = request.headers.get("x-api-key")
    if raw is None:
        auth = request.headers.get("authorization", "")
        raw = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    if not raw:
        raise unauthenticated("x-api-key header is required")
    found, ctx = state.cached_auth(raw)
    if not found:
        ctx = await run_in_threadpool(state.authenticate, raw)
    if ctx is None:
        raise unauthenticated("invalid x-api-key")
    return ctx


CallerDep = Annotated[KeyContext, Depends(get_caller)]


async def message_caller(ctx: CallerDep) -> KeyContext:
    if ctx.is_admin:
        raise forbidden("admin keys cannot send messages; use an API key")
    return ctx


async def admin_caller(ctx: CallerDep) -> KeyContext:
    if not ctx.is_admin:
        raise forbidden("this endpoint needs an admin key")
    return ctx


MessageCallerDep = Annotated[KeyContext, Depends(message_caller)]
AdminCallerDep = Annotated[KeyContext, Depends(admin_caller)]


def _noop(beta: str, families: list[str]) -> bool:
    """Whether ``beta`` is FAMILY-DATE for one of the no-op families."""
    dated = DATED_BETA.match(beta)
    return dated is not None and dated.group(1) in families


async def get_betas(request: Request, state: StateDep) -> set[str]:
    version = request.headers.get("anthropic-version")
    if version is not None and not API_VERSION.match(version):
        raise invalid(f"anthropic-version: {version!r} is not a version date (YYYY-MM-DD)")
    betas: set[str] = set()
    for header in request.headers.getlist("anthropic-beta"):
        betas.update(b.strip() for b in header.split(",") if b.strip())
    settings = state.settings
    known = set(settings.known_betas) | set(settings.cache_key_betas)
    ignored = [
        b for b in sorted(betas) if b not in known and not _noop(b, settings.noop_beta_families)
    ]
    if ignored and settings.strict_betas:
        raise invalid(f"Unsupported beta header: {ignored[0]}")
    if ignored:
        # NOTE: accepted, as a newer client's betas must not fail its first request; the
        # header (streams too: the middleware adds it to every response start) says
        # which ones had no effect. They stay in the set: none is a cache-key beta.
        extra_headers(request.scope).append((IGNORED_BETAS_HEADER, ",".join(ignored)))
    return betas


BetasDep = Annotated[set[str], Depends(get_betas)]
