"""From a finished (or cut short) generation to one ledger row, traced."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import anyio
from opentelemetry import trace
from opentelemetry.trace import Span
from starlette.concurrency import run_in_threadpool

from cachepoint.billing import Buckets
from cachepoint.gateway.billing.ledger import Attribution, Charge
from cachepoint.gateway.diagnostics import NO_DIVERGENCE, outcome_reason
from cachepoint.gateway.fleet.routing import RouteRequest
from cachepoint.gateway.observability.tracing import usage_attributes
from cachepoint.gateway.pipeline import Prepared
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy.tenants import KeyContext

log = logging.getLogger(__name__)

SESSION_HEADER = "x-claude-code-session-id"
MAX_SESSION_ID = 128  # the ledger column's width
MAX_USER_ID = 512  # the ledger column's width


def attribution_of(
    rid: str, headers: Mapping[str, str], req: MessagesRequest, requested: str
) -> Attribution:
    """The session (Claude Code's header), the user (``metadata.user_id``) and the
    client's model name when an alias resolved it, for the ledger row.

    NOTE: a malformed session header is dropped with a log line, never a 400: it is a
    billing label, and refusing the request over it would break the client's session.
    """
    session = headers.get(SESSION_HEADER)
    if session is not None:
        session = session.strip()
        if not session or len(session) > MAX_SESSION_ID or not session.isprintable():
            log.info(
                "request %s: %s ignored (empty, over %d chars, or not printable)",
                rid,
                SESSION_HEADER,
                MAX_SESSION_ID,
            )
            session = None
    user = req.metadata.user_id if req.metadata is not None else None
    return Attribution(
        session_id=session,
        user_id=user[:MAX_USER_ID] if user else None,
        requested_model=requested if requested != req.model else None,
    )


def charge_of(
    rid: str,
    ctx: KeyContext,
    req: MessagesRequest,
    replica: str,
    p: Prepared,
    b: Buckets,
    replica_started_s: float | None = None,
    *,
    now_s: float | None = None,
    evicted_from: Callable[[int], str | None] | None = None,
) -> Charge:
    """The ledger row's charge. A turn compared with the one before whose prompt only
    appended, yet read less than that turn cached, gets the server's reason for it
    (`outcome_reason`: not retained, routed elsewhere, replica restarted, expired,
    evicted), the tokens it missed, and what the server knows beyond: the replica the
    entry is on, or the tier an evicted entry was last in (``evicted_from``: the tier
    of the block holding a token, when the replica's events removed it)."""
    who = p.who
    if p.previous is not None and who.miss_reason == NO_DIVERGENCE:
        read = b.cache_read_input_tokens
        why = outcome_reason(
            p.previous,
            replica=replica,
            read=read,
            now_s=time.time() if now_s is None else now_s,
            replica_started_s=replica_started_s,
        )
        if why is not None:
            detail = None
            if why == "routed_elsewhere":
                detail = f"entry on {p.previous.replica}"
            elif why == "entry_evicted" and evicted_from is not None:
                tier = evicted_from(read)
                detail = f"tier {tier}" if tier is not None else None
            missed = p.previous.cached_end - read
            who = replace(who, miss_reason=why, miss_tokens=missed, miss_detail=detail)
    return Charge(
        rid,
        ctx.org_id,
        ctx.workspace_id,
        ctx.key_id,
        req.model,
        replica,
        p.plan.scope,
        b,
        who,
    )


def charge_for(
    state: GatewayState,
    rid: str,
    ctx: KeyContext,
    req: MessagesRequest,
    replica: str,
    p: Prepared,
    b: Buckets,
) -> Charge:
    """`charge_of` with what the gateway knows now: its clock, when the replica started,
    and the tiers the replica's events removed blocks from."""

    def evicted_from(token: int) -> str | None:
        route = RouteRequest(p.rendered.tokens, p.plan.key_spans, req.model)
        return state.router.evicted_from(replica, route, token)

    started = state.router.started_s(replica)
    return charge_of(
        rid, ctx, req, replica, p, b, started, now_s=state.clock(), evicted_from=evicted_from
    )


async def bill(state: GatewayState, charge: Charge, parent: Span | None = None) -> None:
    """Write the usage row (idempotent by request id).

    NOTE: shielded, because the callers that matter most run while being cancelled: a
    stream whose client hung up, or a generation stopped for the same reason. The
    write must still happen, and it must not block the event loop.
    """
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    server = parent or trace.get_current_span()
    with anyio.CancelScope(shield=True):
        with state.tracer.start_as_current_span("bill", context=ctx) as span:
            cost = await run_in_threadpool(state.bill, charge)
            span.set_attribute("cachepoint.ledger.inserted", cost is not None)
            reason = charge.who.miss_reason
            if reason is not None:
                missed = charge.who.miss_tokens
                attrs = {"cachepoint.cache.miss_reason": reason}
                attrs |= {"cachepoint.cache.miss_tokens": missed} if missed else {}
                span.set_attributes(attrs)
                server.set_attributes(attrs)
                if cost is not None:  # once per request, as billed
                    state.metrics.diagnoses.labels(reason).inc()
            span.set_attributes(usage_attributes(charge.buckets, cost))
            server.set_attributes(usage_attributes(charge.buckets))
