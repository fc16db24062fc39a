"""POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from cachepoint.gateway import streaming
from cachepoint.gateway.accounting import attribution_of, bill, charge_for
from cachepoint.gateway.api.calls import MessagesCallDep
from cachepoint.gateway.api.common import (
    answer,
    client_gone,
    declared,
    diagnose_turn,
    intake_full,
    resolved,
)
from cachepoint.gateway.api.deps import BetasDep, MessageCallerDep, StateDep
from cachepoint.gateway.api.limits import CountLimitDep
from cachepoint.gateway.api.openapi import request_body
from cachepoint.gateway.billing.ledger import Attribution
from cachepoint.gateway.contract import context_edits
from cachepoint.gateway.dispatch import generate, open_watched, pick
from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.fleet.routing import RouteRequest
from cachepoint.gateway.intake import IntakeFull, read_body, trim_after
from cachepoint.gateway.observability import requestlog
from cachepoint.gateway.observability.tracing import render_attributes
from cachepoint.gateway.pipeline import (
    Prepared,
    ReportLimits,
    buckets_of,
    count_limit,
    plan_cache,
    prepare,
    render_prompt,
    usage_of,
)
from cachepoint.gateway.schemas.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    diagnostics_requested,
)
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.streaming import StreamJob
from cachepoint.gateway.tenancy import idempotency
from cachepoint.gateway.tenancy.tenants import KeyContext

log = logging.getLogger(__name__)

router = APIRouter(tags=["messages"])

_Body = TypeVar("_Body", MessagesRequest, CountTokensRequest)

SCOPE_HEADER = "cachepoint-cache-scope"
REPLICA_HEADER = "cachepoint-replica"


async def _read_count_body(
    request: Request, state: GatewayState, ctx: KeyContext
) -> CountTokensRequest:
    """count_tokens' body, parsed, checked and validated in an intake thread
    (messages parse and prepare in one job: ``_intake_job``)."""
    raw = await request.body()
    try:
        t0 = time.perf_counter()
        body = await state.intake.run(
            ctx.org_id, read_body, raw, CountTokensRequest, state.body_limits
        )
        state.metrics.intake_seconds.labels("count_tokens_parse").observe(time.perf_counter() - t0)
        return body
    finally:
        trim_after(len(raw))


def _prepare_job(
    body: MessagesRequest,
    ctx: KeyContext,
    betas: set[str],
    state: GatewayState,
    rid: str,
    who: Attribution,
    keyed: bool,
) -> tuple[Prepared, str | None]:
    """Render, tokenize and plan (and the idempotency fingerprint): an intake job."""
    prepared = prepare(
        body,
        ctx=ctx,
        betas=betas,
        settings=state.settings,
        renderer=state.renderer,
        request_id=rid,
        who=who,
    )
    digest = idempotency.fingerprint(body, betas) if keyed else None
    return prepared, digest


def _intake_job(
    raw: bytes,
    served: frozenset[str],
    ctx: KeyContext,
    betas: set[str],
    state: GatewayState,
    rid: str,
    headers: Mapping[str, str],
    keyed: bool,
) -> tuple[MessagesRequest, Prepared | None, str | None]:
    """Parse and check the body, then, when it names a served model (no alias to look
    up), prepare it in the same job: one thread hop per request, not two."""
    body = read_body(raw, MessagesRequest, state.body_limits)
    if body.model not in served:
        return body, None, None
    who = attribution_of(rid, headers, body, body.model)
    return body, *_prepare_job(body, ctx, betas, state, rid, who, keyed)


@router.post(
    "/v1/messages", response_model=MessageResponse, openapi_extra=request_body(MessagesRequest)
)
async def create_message(request: Request, call: MessagesCallDep) -> Any:
    t_start = time.perf_counter()
    state, ctx, rid, betas = call.state, call.ctx, call.rid, call.betas
    key = idempotency.key_from(request)
    server = trace.get_current_span()
    server.set_attributes({"cachepoint.request_id": rid, "cachepoint.org": ctx.org_id})
    try:
        async with state.intake.admitted(ctx.org_id, declared(request, state)):
            raw = await request.body()
            # NOTE: the served set is read here, on the loop that updates the directory.
            served = frozenset(state.models())
            try:
                with state.tracer.start_as_current_span("render") as span:
                    t0 = time.perf_counter()
                    body, prepared, digest = await state.intake.run(
                        ctx.org_id,
                        _intake_job,
                        raw,
                        served,
                        ctx,
                        betas,
                        state,
                        rid,
                        request.headers,
                        key is not None,
                        size=len(raw),
                    )
                    requestlog.note_request(ctx, body.model, bool(body.stream))
                    server.set_attributes(
                        {"gen_ai.request.model": body.model, "gen_ai.operation.name": "chat"}
                    )
                    if prepared is None:  # an alias: resolved here (it may read the database)
                        requested = body.model
                        body = await resolved(state, body)
                        who = attribution_of(rid, request.headers, body, requested)
                        prepared, digest = await state.intake.run(
                            ctx.org_id,
                            _prepare_job,
                            body,
                            ctx,
                            betas,
                            state,
                            rid,
                            who,
                            key is not None,
                            size=len(raw),
                        )
                    state.metrics.intake_seconds.labels("messages").observe(
                        time.perf_counter() - t0
                    )
                    span.set_attributes(render_attributes(prepared.rendered, prepared.plan))
            finally:
                trim_after(len(raw))
    except IntakeFull:
        raise intake_full(state) from None
    if prepared.fingerprint is not None:
        previous = body.diagnostics.previous_message_id if body.diagnostics else None
        prepared = await diagnose_turn(
            state,
            ctx,
            rid,
            prepared,
            opted_in=diagnostics_requested(body),
            previous_id=previous,
            session_id=prepared.session,
        )
    claim: idempotency.Claim | None = None
    if key is not None:
        got = await idempotency.begin(
            state.sessions.kw["bind"],
            ctx,
            key,
            digest or "",
            rid,
            state.settings.upstream_timeout_s,
            request.is_disconnected,
            lease_s=state.settings.idempotency_lease_s,
            bill_cut=state.bill,  # a crashed attempt's delivered part, when taken over
        )
        if isinstance(got, idempotency.Recorded):
            return got.response()
        claim = got
    try:
        respond = _stream if body.stream else _complete
        return await respond(
            body,
            request,
            state=state,
            ctx=ctx,
            rid=rid,
            prepared=prepared,
            t_start=t_start,
            claim=claim,
        )
    except BaseException:
        if claim is not None:
            await claim.release()
        raise


async def _complete(
    body: MessagesRequest,
    request: Request,
    *,
    state: GatewayState,
    ctx: KeyContext,
    rid: str,
    prepared: Prepared,
    t_start: float,
    claim: idempotency.Claim | None,
) -> Response:
    route = RouteRequest(prepared.rendered.tokens, prepared.plan.key_spans, body.model)
    limits = ReportLimits.of(prepared)
    t_up = time.perf_counter()
    # NOTE: with an idempotency key the generation runs to its end even if the client
    # hangs up: its retry (same key) then gets this result, generated and billed once.
    # Without one, a hang-up stops the replica and only what was generated is billed.
    gone = None if claim is not None else request.is_disconnected
    gen = await generate(
        state,
        route=route,
        routed=pick(state, route),
        request=prepared.payload,
        limits=limits,
        client_gone=gone,
    )
    upstream = time.perf_counter() - t_up
    result = gen.result
    if gen.cache is None:  # gone before prefill_done: the replica dropped it, nothing to bill
        return client_gone(state, rid, "while queued or prefilling")
    b = buckets_of(gen.cache, gen.output_tokens, limits)
    # NOTE: billed before the response leaves; the request id makes a retry a no-op.
    await bill(state, charge_for(state, rid, ctx, body, gen.replica, prepared, b))
    if result is None:
        return client_gone(state, rid, f"after {gen.output_tokens} output tokens")
    headers = {SCOPE_HEADER: prepared.plan.scope, REPLICA_HEADER: gen.replica}
    headers |= prepared.degraded
    content, stop_reason, stop_sequence = answer(body, result, prepared.forcing)
    msg = MessageResponse(
        id=f"msg_{rid.removeprefix('req_')}",
        content=content,
        model=body.model,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_of(b),
        context_management=context_edits.report(prepared.rendered.applied_edits),
    )
    msg.diagnostics = prepared.diagnosis
    unset = set()
    if msg.context_management is None:
        unset.add("context_management")
    if not diagnostics_requested(body):
        unset.add("diagnostics")  # not asked for: no field (the SDKs read it as null)
    response = JSONResponse(msg.model_dump(exclude=unset or None), headers=headers)
    if claim is not None:
        await claim.complete(200, headers, bytes(response.body), "json")
    metrics = state.metrics
    metrics.upstream_seconds.observe(upstream)
    metrics.overhead.observe(time.perf_counter() - t_start - upstream)
    metrics.requests.labels("ok").inc()
    return response


async def _stream(
    body: MessagesRequest,
    request: Request,
    *,
    state: GatewayState,
    ctx: KeyContext,
    rid: str,
    prepared: Prepared,
    t_start: float,
    claim: idempotency.Claim | None,
) -> Response:
    # Open the upstream and wait for its prefill before answering, so that failures
    # up to that point are real HTTP errors rather than an SSE error event.
    route = RouteRequest(prepared.rendered.tokens, prepared.plan.key_spans, body.model)
    limits = ReportLimits.of(prepared)
    t_open = time.perf_counter()
    routed = pick(state, route)
    opened = await open_watched(
        state,
        route=route,
        routed=routed,
        request=prepared.payload,
        limits=limits,
        client_gone=request.is_disconnected,
    )
    if opened is None:  # gone before prefill_done: the replica dropped it, nothing to bill
        if claim is not None:
            await claim.release()
        return client_gone(state, rid, "while queued or prefilling")
    headers = {SCOPE_HEADER: prepared.plan.scope, REPLICA_HEADER: opened.replica.name}
    headers |= prepared.degraded
    job = StreamJob(
        state=state,
        ctx=ctx,
        body=body,
        rid=rid,
        prepared=prepared,
        limits=limits,
        opened=opened,
        headers=headers,
        t_start=t_start,
        t_open=t_open,
        claim=claim,
    )
    return streaming.respond(job)


def _count_job(
    body: CountTokensRequest, ctx: KeyContext, betas: set[str], state: GatewayState
) -> int:
    """count_tokens' render and contract checks: an intake job."""
    settings = state.settings
    rendered, _ = render_prompt(body, state.renderer, count_limit(settings, body.model))
    plan_cache(rendered, body, ctx, betas, settings)  # the same contract errors
    return len(rendered)


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    openapi_extra=request_body(CountTokensRequest),
)
async def count_tokens(
    request: Request,
    state: StateDep,
    ctx: MessageCallerDep,
    betas: BetasDep,
    _limit: CountLimitDep,
) -> CountTokensResponse:
    counted = state.metrics.count_tokens
    try:
        async with state.intake.admitted(ctx.org_id, declared(request, state)):
            body = await _read_count_body(request, state, ctx)
            requestlog.note_request(ctx, body.model, False)
            body = await resolved(state, body)
            n = await state.intake.run(ctx.org_id, _count_job, body, ctx, betas, state)
    except IntakeFull:
        counted.labels("rate_limited").inc()
        raise intake_full(state) from None
    except (ApiError, RequestValidationError):
        counted.labels("invalid").inc()
        raise
    counted.labels("ok").inc()
    return CountTokensResponse(input_tokens=n)
