"""POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span
from starlette.concurrency import run_in_threadpool

from ...contract.billing import Buckets
from ...errors import ApiError, envelope, not_found
from ...ledger import Charge
from ...pipeline import Prepared, buckets_of, plan_cache, prepare, usage_of
from ...schemas.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextOut,
)
from ...state import GatewayState
from ...tenants import KeyContext
from ...tracing import render_attributes, usage_attributes
from ...upstream import ReplicaClient, ReplicaUnreachableError, Routed, RouteRequest
from ..deps import BetasDep, MessageCallerDep, RequestIdDep, StateDep

router = APIRouter(tags=["messages"])

SCOPE_HEADER = "cachepoint-cache-scope"
REPLICA_HEADER = "cachepoint-replica"


def _check_model(state: GatewayState, model: str) -> None:
    if model not in state.models():
        raise not_found(f"model: {model}")


def _charge(
    rid: str, ctx: KeyContext, req: MessagesRequest, replica: str, p: Prepared, b: Buckets
) -> Charge:
    return Charge(
        rid, ctx.org_id, ctx.workspace_id, ctx.key_id, req.model, replica, p.plan.scope, b
    )


@router.post("/v1/messages", response_model=MessageResponse)
async def create_message(
    body: MessagesRequest,
    state: StateDep,
    ctx: MessageCallerDep,
    betas: BetasDep,
    rid: RequestIdDep,
) -> Any:
    t_start = time.perf_counter()
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
    tracer = state.tracer
    with tracer.start_as_current_span("render") as span:
        prepared = prepare(body, ctx, betas, state.settings, state.renderer, rid)
        span.set_attributes(render_attributes(prepared.rendered, prepared.plan))
    route = RouteRequest(prepared.rendered.tokens, prepared.plan.key_spans, body.model)
    routed = _route(state, route)
    headers = {SCOPE_HEADER: prepared.plan.scope}
    if body.stream:
        return await _stream(body, state, ctx, rid, prepared, route, routed, headers, t_start)
    t_up = time.perf_counter()
    try:
        result = await routed.replica.generate(prepared.payload)
    except ReplicaUnreachableError:
        # It died before its heartbeat went stale: route once more, elsewhere.
        state.router.report_failure(routed.replica.name)
        routed = _route(state, route)
        result = await routed.replica.generate(prepared.payload)
    upstream = time.perf_counter() - t_up
    replica = routed.replica
    headers[REPLICA_HEADER] = replica.name
    b = buckets_of(result["cache"], int(result["output_tokens"]))
    # NOTE: billed before the response leaves; the request id makes a retry a no-op.
    await _bill(state, _charge(rid, ctx, body, result.get("replica", replica.name), prepared, b))
    msg = MessageResponse(
        id=f"msg_{rid.removeprefix('req_')}",
        content=[TextOut(text=result["text"])],
        model=body.model,
        stop_reason=result["stop_reason"],
        stop_sequence=result.get("stop_sequence"),
        usage=usage_of(b),
    )
    response = JSONResponse(msg.model_dump(), headers=headers)
    metrics = state.metrics
    metrics.upstream_seconds.observe(upstream)
    metrics.overhead.observe(time.perf_counter() - t_start - upstream)
    metrics.requests.labels("ok").inc()
    return response


def _route(state: GatewayState, route: RouteRequest) -> Routed:
    with state.tracer.start_as_current_span("route") as span:
        try:
            routed = state.router.pick(route)
        except ApiError:
            state.metrics.route_decisions.labels("-", "no_replica").inc()
            raise
        policy = routed.decision.policy if routed.decision else "static"
        state.metrics.route_decisions.labels(policy, "routed").inc()
        span.set_attribute("cachepoint.route.replica", routed.replica.name)
        if routed.decision is not None:
            span.set_attributes(routed.decision.span_attributes())
        age = state.router.freshness_s(routed.replica.name)
        if age is not None:
            span.set_attribute("cachepoint.route.index_age_s", age)
        return routed


async def _bill(state: GatewayState, charge: Charge, parent: Span | None = None) -> None:
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    server = parent or trace.get_current_span()
    with state.tracer.start_as_current_span("bill", context=ctx) as span:
        cost = await run_in_threadpool(state.bill, charge)
        span.set_attribute("cachepoint.ledger.inserted", cost is not None)
        span.set_attributes(usage_attributes(charge.buckets, cost))
        server.set_attributes(usage_attributes(charge.buckets))


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _timed(
    events: AsyncIterator[dict[str, Any]], waited: list[float]
) -> AsyncIterator[dict[str, Any]]:
    """Relay ``events``, adding the time spent waiting on each to ``waited[0]``: a
    stream's gateway overhead is its total time less this."""
    while True:
        t = time.perf_counter()
        try:
            ev = await anext(events)
        except StopAsyncIteration:
            waited[0] += time.perf_counter() - t
            return
        waited[0] += time.perf_counter() - t
        yield ev


async def _open(
    stack: AsyncExitStack, replica: ReplicaClient, payload: dict[str, Any]
) -> tuple[AsyncIterator[dict[str, Any]], dict[str, Any]]:
    try:
        events = await stack.enter_async_context(replica.stream(payload))
        return events, await anext(events)
    except BaseException:
        await stack.aclose()
        raise


async def _stream(
    body: MessagesRequest,
    state: GatewayState,
    ctx: KeyContext,
    rid: str,
    prepared: Prepared,
    route: RouteRequest,
    routed: Routed,
    headers: dict[str, str],
    t_start: float,
) -> StreamingResponse:
    # Open the upstream and wait for its prefill before answering, so that failures
    # up to that point are real HTTP errors rather than an SSE error event.
    stack = AsyncExitStack()
    t_open = time.perf_counter()
    try:
        events, first = await _open(stack, routed.replica, prepared.payload)
    except ReplicaUnreachableError:
        state.router.report_failure(routed.replica.name)
        routed = state.router.pick(route)
        stack = AsyncExitStack()
        events, first = await _open(stack, routed.replica, prepared.payload)
    replica = routed.replica
    headers = {**headers, REPLICA_HEADER: replica.name}
    if first.get("type") != "prefill_done":
        await stack.aclose()
        err = first.get("error", {})
        raise ApiError(500, str(err.get("type", "api_error")), str(err.get("message", first)))
    cache = first["cache"]
    msg_id = f"msg_{rid.removeprefix('req_')}"
    server = trace.get_current_span()

    now = time.perf_counter()
    state.metrics.ttft.observe(now - t_open)
    waited = [now - t_open]  # seconds spent waiting on the replica, so far

    async def sse() -> AsyncIterator[bytes]:
        output = 0
        billed = False

        async def bill(out_tokens: int) -> None:
            nonlocal billed
            if not billed:
                billed = True
                b = buckets_of(cache, out_tokens)
                await _bill(state, _charge(rid, ctx, body, replica.name, prepared, b), server)

        try:
            start_usage = usage_of(buckets_of(cache, 0)).model_dump()
            yield _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": msg_id,
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": body.model,
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": start_usage,
                    },
                },
            )
            yield _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            yield _sse("ping", {"type": "ping"})
            final: dict[str, Any] | None = None
            async for ev in _timed(events, waited):
                kind = ev.get("type")
                if kind == "token":
                    output += 1
                    if ev.get("text"):
                        delta = {"type": "text_delta", "text": ev["text"]}
                        yield _sse(
                            "content_block_delta",
                            {"type": "content_block_delta", "index": 0, "delta": delta},
                        )
                elif kind == "done":
                    final = ev["response"]
                    break
                elif kind == "error":
                    await bill(output)
                    err = ev.get("error", {})
                    yield _sse(
                        "error",
                        envelope(str(err.get("type", "api_error")), str(err.get("message")), rid),
                    )
                    return
            if final is None:
                await bill(output)
                yield _sse("error", envelope("api_error", "replica stream ended early", rid))
                return
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            out_tokens = int(final["output_tokens"])
            await bill(out_tokens)
            usage = usage_of(buckets_of(cache, out_tokens)).model_dump()
            usage.pop("cache_creation")
            yield _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": final["stop_reason"],
                        "stop_sequence": final.get("stop_sequence"),
                    },
                    "usage": usage,
                },
            )
            yield _sse("message_stop", {"type": "message_stop"})
            metrics = state.metrics
            metrics.upstream_seconds.observe(waited[0])
            metrics.overhead.observe(time.perf_counter() - t_start - waited[0])
            metrics.requests.labels("ok").inc()
        finally:
            # A client that went away still pays for what was computed. NOTE: a
            # cancelled generator cannot await the worker thread, so this write is
            # synchronous; it happens only on hang-ups.
            if not billed:
                billed = True
                state.bill(
                    _charge(rid, ctx, body, replica.name, prepared, buckets_of(cache, output))
                )
            await stack.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse)
async def count_tokens(
    body: CountTokensRequest, state: StateDep, ctx: MessageCallerDep, betas: BetasDep
) -> CountTokensResponse:
    _check_model(state, body.model)
    rendered = state.renderer.render(body)
    plan_cache(rendered, body, ctx, betas, state.settings)  # the same contract errors
    return CountTokensResponse(input_tokens=len(rendered))
