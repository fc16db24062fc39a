"""POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from ... import idempotency, requestlog, streaming
from ...accounting import bill, charge_of
from ...contract import toolcalls
from ...dispatch import generate, open_watched, pick
from ...errors import envelope, not_found
from ...pipeline import (
    Prepared,
    ReportLimits,
    buckets_of,
    plan_cache,
    prepare,
    render_prompt,
    usage_of,
)
from ...schemas.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextOut,
    ToolUseOut,
)
from ...state import GatewayState
from ...streaming import StreamJob
from ...tenants import KeyContext
from ...tracing import render_attributes
from ...upstream import RouteRequest
from ..deps import BetasDep, MessageCallerDep, RequestIdDep, StateDep
from ..limits import RateLimitDep

log = logging.getLogger(__name__)

router = APIRouter(tags=["messages"])

SCOPE_HEADER = "cachepoint-cache-scope"
REPLICA_HEADER = "cachepoint-replica"


def _check_model(state: GatewayState, model: str) -> None:
    if model not in state.models():
        raise not_found(f"model: {model}")


@router.post("/v1/messages", response_model=MessageResponse)
async def create_message(
    body: MessagesRequest,
    request: Request,
    state: StateDep,
    ctx: MessageCallerDep,
    betas: BetasDep,
    rid: RequestIdDep,
    _limit: RateLimitDep,
) -> Any:
    t_start = time.perf_counter()
    requestlog.note_request(ctx, body.model, bool(body.stream))
    server = trace.get_current_span()
    server.set_attributes(
        {
            "cachepoint.request_id": rid,
            "gen_ai.request.model": body.model,
            "gen_ai.operation.name": "chat",
            "cachepoint.org": ctx.org_id,
        }
    )
    _check_model(state, body.model)
    key = idempotency.key_from(request)
    with state.tracer.start_as_current_span("render") as span:
        prepared = prepare(body, ctx, betas, state.settings, state.renderer, rid)
        span.set_attributes(render_attributes(prepared.rendered, prepared.plan))
    claim: idempotency.Claim | None = None
    if key is not None:
        got = await idempotency.begin(
            state.sessions.kw["bind"],
            ctx,
            key,
            idempotency.fingerprint(body, betas),
            rid,
            state.settings.upstream_timeout_s,
            request.is_disconnected,
        )
        if isinstance(got, idempotency.Recorded):
            return got.response()
        claim = got
    try:
        if body.stream:
            return await _stream(body, request, state, ctx, rid, prepared, t_start, claim)
        return await _complete(body, request, state, ctx, rid, prepared, t_start, claim)
    except BaseException:
        if claim is not None:
            await claim.release()
        raise


async def _complete(
    body: MessagesRequest,
    request: Request,
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
    gen = await generate(state, route, pick(state, route), prepared.payload, limits, gone)
    upstream = time.perf_counter() - t_up
    result = gen.result
    if gen.cache is None:  # gone before prefill_done: the replica dropped it, nothing to bill
        return _client_gone(state, rid, "while queued or prefilling")
    b = buckets_of(gen.cache, gen.output_tokens, limits)
    # NOTE: billed before the response leaves; the request id makes a retry a no-op.
    await bill(state, charge_of(rid, ctx, body, gen.replica, prepared, b))
    if result is None:
        return _client_gone(state, rid, f"after {gen.output_tokens} output tokens")
    headers = {SCOPE_HEADER: prepared.plan.scope, REPLICA_HEADER: gen.replica}
    content, stop_reason, stop_sequence = _answer(body, result, prepared.forcing)
    msg = MessageResponse(
        id=f"msg_{rid.removeprefix('req_')}",
        content=content,
        model=body.model,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=usage_of(b),
    )
    response = JSONResponse(msg.model_dump(), headers=headers)
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
        state, route, routed, prepared.payload, limits, request.is_disconnected
    )
    if opened is None:  # gone before prefill_done: the replica dropped it, nothing to bill
        if claim is not None:
            await claim.release()
        return _client_gone(state, rid, "while queued or prefilling")
    headers = {SCOPE_HEADER: prepared.plan.scope, REPLICA_HEADER: opened.replica.name}
    job = StreamJob(
        state, ctx, body, rid, prepared, limits, opened, headers, t_start, t_open, claim
    )
    return streaming.respond(job)


def _answer(
    body: MessagesRequest, result: dict[str, Any], forced: toolcalls.Forcing
) -> tuple[list[Any], Any, Any]:
    """The replica's text as content blocks, its tool calls as ``tool_use`` blocks."""
    text, stop_reason, stop_sequence = forced.settle(
        result["text"], result["stop_reason"], result.get("stop_sequence")
    )
    names = toolcalls.offered(body)
    if names is None:
        return [TextOut(text=text)], stop_reason, stop_sequence
    content = [
        ToolUseOut(id=p.id, name=p.name, input=p.input)
        if isinstance(p, toolcalls.ToolCall)
        else TextOut(text=p.text)
        for p in toolcalls.split(text, names)
    ]
    if any(isinstance(block, ToolUseOut) for block in content):
        return content, "tool_use", None
    return content, stop_reason, stop_sequence


def _client_gone(state: GatewayState, rid: str, when: str) -> JSONResponse:
    log.info("request %s: client went away %s", rid, when)
    state.metrics.requests.labels("client_gone").inc()
    return JSONResponse(envelope("api_error", "client disconnected", rid), 499)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
async def count_tokens(
    body: CountTokensRequest, state: StateDep, ctx: MessageCallerDep, betas: BetasDep
) -> CountTokensResponse:
    requestlog.note_request(ctx, body.model, False)
    _check_model(state, body.model)
    rendered, _ = render_prompt(body, state.renderer)
    plan_cache(rendered, body, ctx, betas, state.settings)  # the same contract errors
    return CountTokensResponse(input_tokens=len(rendered))
