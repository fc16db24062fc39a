"""POST /v1/chat/completions and /v1/completions: OpenAI's API on the same pipeline,
cache, routing and ledger as /v1/messages (docs/openai.md).

A chat request becomes the Messages request it means (`gateway/contract/openai.py`)
and is rendered through the model's chat template; a completion's prompt is tokenized
as it is. Both then go the Messages path's way: routing, the replica protocol,
tracing, billing. What differs is OpenAI's caching contract (automatic, engine hits
billed as cached reads, no write surcharge: `ApiOptions.implicit_min`), its answers,
its stream and its error envelope.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from cachepoint.billing import Buckets
from cachepoint.gateway import streaming
from cachepoint.gateway.accounting import attribution_of, bill, charge_for
from cachepoint.gateway.api.calls import OpenAICallDep
from cachepoint.gateway.api.common import (
    answer,
    client_gone,
    declared,
    diagnose_turn,
    intake_full,
    resolved,
)
from cachepoint.gateway.api.openapi import request_body
from cachepoint.gateway.billing.ledger import Attribution
from cachepoint.gateway.contract.openai import (
    Translated,
    completion_refusals,
    finish_reason,
    refuse,
    translate,
)
from cachepoint.gateway.dispatch import generate, open_watched, pick
from cachepoint.gateway.fleet.routing import RouteRequest
from cachepoint.gateway.intake import IntakeFull, read_body, trim_after
from cachepoint.gateway.observability import requestlog
from cachepoint.gateway.observability.tracing import render_attributes
from cachepoint.gateway.pipeline import (
    ApiOptions,
    Prepared,
    ReportLimits,
    buckets_of,
    prepare,
    prepare_tokens,
)
from cachepoint.gateway.profiles import profile_of
from cachepoint.gateway.schemas.messages import MessagesRequest, Metadata, ToolUseOut
from cachepoint.gateway.schemas.openai import ChatCompletionRequest, CompletionRequest
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.streaming import StreamJob
from cachepoint.gateway.streaming_openai import ChatChunks, TextChunks, openai_usage
from cachepoint.gateway.tenancy import aliases, idempotency
from cachepoint.gateway.tenancy.tenants import KeyContext
from cachepoint.protocol import CacheReport, GenerateResponse

log = logging.getLogger(__name__)

router = APIRouter(tags=["openai"])

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
REPLICA_HEADER = "cachepoint-replica"
RETENTION_REFUSED_HEADER = "cachepoint-retention-refused"


def _options(state: GatewayState, t: Translated | None, clamp: bool) -> ApiOptions:
    """OpenAI's sampling and caching contract on the payload and the bill."""
    return ApiOptions(
        temperature=t.temperature if t is not None else None,
        seed=t.seed if t is not None else None,
        top_k=t.top_k if t is not None else None,
        ignore_eos=t.ignore_eos if t is not None else False,
        retain_24h=t.retain_24h if t is not None else False,
        session=f"openai:{t.cache_key}" if t is not None and t.cache_key else None,
        clamp=True if clamp else None,
        implicit_min=state.settings.openai_min_cached_tokens,
    )


def _who(base: Attribution, api: str, cache_key: str | None) -> Attribution:
    return replace(base, api=api, cache_key=cache_key)


def _chat_prepare(
    t: Translated,
    ctx: KeyContext,
    state: GatewayState,
    rid: str,
    headers: Mapping[str, str],
    requested: str,
) -> Prepared:
    """Render, tokenize and plan a translated chat request: an intake job."""
    who = _who(attribution_of(rid, headers, t.body, requested), "chat.completions", t.cache_key)
    return prepare(
        t.body,
        ctx=ctx,
        betas=set(),
        settings=state.settings,
        renderer=state.renderer,
        request_id=rid,
        who=who,
        options=_options(state, t, t.clamp),
    )


def _chat_job(
    raw: bytes,
    served: frozenset[str],
    ctx: KeyContext,
    state: GatewayState,
    rid: str,
    headers: Mapping[str, str],
) -> tuple[ChatCompletionRequest, Translated, Prepared | None]:
    """Parse, check and translate the body, then (a served model, no alias to look up)
    prepare it in the same job."""
    chat = read_body(raw, ChatCompletionRequest, state.body_limits)
    window = profile_of(state.settings, chat.model).context_window
    t = translate(chat, default_max_tokens=window)
    if chat.model not in served:
        return chat, t, None
    return chat, t, _chat_prepare(t, ctx, state, rid, headers, chat.model)


async def _admitted_job(request: Request, state: GatewayState, ctx: KeyContext, job, *args):
    """Run ``job`` on the body in the org's intake share; (result, raw size)."""
    try:
        async with state.intake.admitted(ctx.org_id, declared(request, state)):
            raw = await request.body()
            served = frozenset(state.models())
            try:
                return await state.intake.run(
                    ctx.org_id, job, raw, served, ctx, state, *args, size=len(raw)
                )
            finally:
                trim_after(len(raw))
    except IntakeFull:
        raise intake_full(state) from None


@router.post(CHAT_PATH, openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(
    request: Request,
    call: OpenAICallDep,
) -> Any:
    t_start = time.perf_counter()
    state, ctx, rid = call.state, call.ctx, call.rid
    server = trace.get_current_span()
    server.set_attributes({"cachepoint.request_id": rid, "cachepoint.org": ctx.org_id})
    with state.tracer.start_as_current_span("render") as span:
        t0 = time.perf_counter()
        chat, t, prepared = await _admitted_job(
            request, state, ctx, _chat_job, rid, request.headers
        )
        requestlog.note_request(ctx, chat.model, bool(chat.stream))
        server.set_attributes({"gen_ai.request.model": chat.model, "gen_ai.operation.name": "chat"})
        if prepared is None:  # an alias: resolved here (it may read the database)
            t = replace(t, body=await resolved(state, t.body))
            prepared = await state.intake.run(
                ctx.org_id, _chat_prepare, t, ctx, state, rid, request.headers, chat.model
            )
        state.metrics.intake_seconds.labels("chat_completions").observe(time.perf_counter() - t0)
        span.set_attributes(render_attributes(prepared.rendered, prepared.plan))
    body = t.body
    if prepared.fingerprint is not None:  # a session, or a prompt_cache_key as one
        prepared = await diagnose_turn(
            state,
            ctx,
            rid,
            prepared,
            opted_in=False,
            previous_id=None,
            session_id=prepared.session,
        )
        if not prepared.options.retain_24h:
            # NOTE: in_memory is best effort: a prefix the engine let go is not a
            # miss to explain, only a prompt that changed is.
            prepared = replace(prepared, previous=None)
    call = _Call(request, state, ctx, rid, body, prepared, t_start)
    stream = ChatChunks(_id("chatcmpl", rid), body.model, t.include_usage) if chat.stream else None
    return await _run(call, "chat.completions", chat, stream, _chat_completion)


def _chat_completion(call: _Call, result: GenerateResponse, b: Buckets) -> dict[str, Any]:
    """The collected answer as OpenAI's ``chat.completion``: text, and tool calls."""
    content, stop_reason, _ = answer(call.body, result, call.prepared.forcing)
    text = "".join(getattr(c, "text", "") for c in content)
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": _json(c.input)},
        }
        for c in content
        if isinstance(c, ToolUseOut)
    ]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text if text or not calls else None,
        "refusal": None,
        "annotations": [],
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "id": _id("chatcmpl", call.rid),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": call.body.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason(stop_reason, bool(calls)),
                "logprobs": None,
            }
        ],
        "usage": openai_usage(b),
        "service_tier": "default",
        "system_fingerprint": None,
    }


def _completion_job(
    raw: bytes,
    served: frozenset[str],
    ctx: KeyContext,
    state: GatewayState,
    rid: str,
    headers: Mapping[str, str],
) -> tuple[CompletionRequest, list[int]]:
    """Parse and check the body, and tokenize its prompt as it is: an intake job."""
    req = read_body(raw, CompletionRequest, state.body_limits)
    completion_refusals(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) != 1:
            raise refuse(
                "prompt", "a batch of prompts is not supported here: send one request per prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise refuse("prompt", "the prompt is empty")
        tokens = list(state.renderer.tokenizer.encode(prompt))
    else:
        tokens = list(prompt)
        if not tokens:
            raise refuse("prompt", "the prompt is empty")
        # NOTE: as vLLM does, ids are checked against the tokenizer's vocabulary here:
        # an id past it would fail deeper (a 32-bit overflow in the prompt's array).
        vocab = state.renderer.tokenizer.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise refuse("prompt", f"token id {bad} is out of vocabulary (0..{vocab - 1})")
    return req, tokens


@router.post(COMPLETIONS_PATH, openapi_extra=request_body(CompletionRequest))
async def completions(
    request: Request,
    call: OpenAICallDep,
) -> Any:
    t_start = time.perf_counter()
    state, ctx, rid = call.state, call.ctx, call.rid
    server = trace.get_current_span()
    server.set_attributes({"cachepoint.request_id": rid, "cachepoint.org": ctx.org_id})
    with state.tracer.start_as_current_span("render") as span:
        req, tokens = await _admitted_job(
            request, state, ctx, _completion_job, rid, request.headers
        )
        requestlog.note_request(ctx, req.model, bool(req.stream))
        server.set_attributes({"gen_ai.request.model": req.model})
        # NOTE: a model that is neither served nor an alias is the usual 404.
        model = await aliases.resolve(state, req.model)
        user = req.safety_identifier or req.user
        carrier = MessagesRequest.model_construct(
            model=model, metadata=Metadata(user_id=user) if user else None
        )
        who = _who(
            attribution_of(rid, request.headers, carrier, req.model),
            "completions",
            req.prompt_cache_key,
        )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        prepared = prepare_tokens(
            tokens,
            model=model,
            max_tokens=req.max_tokens or 16,
            sampling=(None, req.top_p, None, stop),
            ctx=ctx,
            settings=state.settings,
            request_id=rid,
            who=who,
            options=replace(
                _options(state, None, False),
                temperature=req.temperature,
                seed=req.seed,
                top_k=req.top_k,
                ignore_eos=bool(req.ignore_eos),
                retain_24h=req.prompt_cache_retention == "24h",
            ),
        )
        span.set_attributes(render_attributes(prepared.rendered, prepared.plan))
    body = _completion_body(model, req)
    call = _Call(request, state, ctx, rid, body, prepared, t_start)
    opts = req.stream_options
    usage = bool(opts and opts.include_usage)
    stream = TextChunks(_id("cmpl", rid), model, usage) if req.stream else None
    return await _run(call, "completions", req, stream, _text_completion)


def _text_completion(call: _Call, result: GenerateResponse, b: Buckets) -> dict[str, Any]:
    """The collected answer as OpenAI's ``text_completion``."""
    return {
        "id": _id("cmpl", call.rid),
        "object": "text_completion",
        "created": int(time.time()),
        "model": call.body.model,
        "choices": [
            {
                "index": 0,
                "text": result.text,
                "logprobs": None,
                "finish_reason": finish_reason(result.stop_reason, False),
            }
        ],
        "usage": openai_usage(b),
        "system_fingerprint": None,
    }


# ---------------------------------------------------------------- shared


@dataclass(frozen=True, slots=True)
class _Call:
    """One prepared request on its way to an answer."""

    request: Request  # the client's (disconnects, headers, path)
    state: GatewayState
    ctx: KeyContext  # who pays
    rid: str  # the gateway's request id
    body: MessagesRequest  # the request as the Messages pipeline reads it
    prepared: Prepared  # rendered, planned, with OpenAI's options
    t_start: float  # perf_counter at arrival


async def _run(
    call: _Call,
    api: str,
    parsed: ChatCompletionRequest | CompletionRequest,
    stream: ChatChunks | TextChunks | None,
    shape: Callable[[_Call, GenerateResponse, Buckets], dict[str, Any]],
) -> Response:
    """Claim the idempotency key (or replay its answer), then stream or collect the
    generation and answer in OpenAI's shape (``shape``); the key is released when
    anything fails before the answer is recorded."""
    claim = await _claim(call, api, parsed)
    if isinstance(claim, Response):
        return claim
    try:
        if stream is not None:
            return await _stream(call, stream, claim)
        got = await _generate(call, claim)
        if isinstance(got, Response):
            return got
        result, b, headers = got
        call.state.metrics.requests.labels("ok").inc()
        # NOTE: the gateway-overhead histogram is the Messages path's (its bench's):
        # not observed here, where the upstream part is not split out of the total.
        response = JSONResponse(shape(call, result, b), headers=headers)
        if claim is not None:
            await claim.complete(200, headers, bytes(response.body), "json")
        return response
    except BaseException:
        if claim is not None:
            await claim.release()
        raise


def _completion_body(model: str, req: CompletionRequest) -> MessagesRequest:
    """The Messages-shaped request the relay and the ledger read for a completion: its
    model and stream flag (no tools; nothing else of it is read after preparing)."""
    return MessagesRequest.model_construct(
        model=model, max_tokens=req.max_tokens or 16, messages=[], stream=bool(req.stream)
    )


async def _generate(
    call: _Call, claim: idempotency.Claim | None
) -> tuple[GenerateResponse, Buckets, dict[str, str]] | Response:
    """One generation, collected and billed: (result, buckets, headers), or the
    response for a client that went away."""
    state, prepared, path = call.state, call.prepared, call.request.url.path
    route = _route(call.ctx, call.body, prepared)
    limits = ReportLimits.of(prepared)
    t_up = time.perf_counter()
    gen = await generate(
        state,
        route=route,
        routed=pick(state, route),
        request=prepared.payload,
        limits=limits,
        # NOTE: as on the Messages API: with an idempotency key the generation runs to
        # its end even if the client hangs up, so that its retry gets this result.
        client_gone=None if claim is not None else call.request.is_disconnected,
    )
    if gen.cache is None:
        return client_gone(state, call.rid, "while queued or prefilling", path)
    b = buckets_of(gen.cache, gen.output_tokens, limits)
    await bill(state, charge_for(state, call.rid, call.ctx, call.body, gen.replica, prepared, b))
    if gen.result is None:
        return client_gone(state, call.rid, f"after {gen.output_tokens} output tokens", path)
    state.metrics.upstream_seconds.observe(time.perf_counter() - t_up)
    return gen.result, b, _headers(gen.replica, gen.cache, prepared)


async def _stream(
    call: _Call, emitter: ChatChunks | TextChunks, claim: idempotency.Claim | None
) -> Response:
    """Open the upstream and wait for its prefill (failures up to there are real HTTP
    errors), then relay it as OpenAI's stream."""
    state, prepared = call.state, call.prepared
    route = _route(call.ctx, call.body, prepared)
    limits = ReportLimits.of(prepared)
    t_open = time.perf_counter()
    opened = await open_watched(
        state,
        route=route,
        routed=pick(state, route),
        request=prepared.payload,
        limits=limits,
        client_gone=call.request.is_disconnected,
    )
    if opened is None:
        if claim is not None:
            await claim.release()
        return client_gone(state, call.rid, "while queued or prefilling", call.request.url.path)
    job = StreamJob(
        state=state,
        ctx=call.ctx,
        body=call.body,
        rid=call.rid,
        prepared=prepared,
        limits=limits,
        opened=opened,
        headers=_headers(opened.replica.name, opened.cache, prepared),
        t_start=call.t_start,
        t_open=t_open,
        claim=claim,
        emitter=emitter,
    )
    return streaming.respond(job)


def _route(ctx: KeyContext, body: MessagesRequest, prepared: Prepared) -> RouteRequest:
    """The routing request, with the prompt_cache_key scoped to the caller's org: a key
    never steers one org's requests by another's."""
    key = prepared.who.cache_key
    affinity = f"org:{ctx.org_id}:{key}" if key is not None else None
    tokens, spans = prepared.rendered.tokens, prepared.plan.key_spans
    return RouteRequest(tokens, spans, body.model, affinity=affinity)


def _headers(replica: str, cache: CacheReport, prepared: Prepared) -> dict[str, str]:
    """The replica that served it, what was degraded, and a 24h retention the replica
    refused (share or org quota full): the prompt was still reused as in_memory."""
    out = {REPLICA_HEADER: replica, **prepared.degraded}
    if prepared.options.retain_24h and cache.retention_refused:
        out[RETENTION_REFUSED_HEADER] = (cache.refusal_reason or "refused")[:200]
    return out


async def _claim(
    call: _Call, api: str, body: ChatCompletionRequest | CompletionRequest
) -> idempotency.Claim | Response | None:
    """With an ``Idempotency-Key``: this request's claim on it, or the first request's
    recorded answer (a replay); None without one. As on the Messages API."""
    request, state, ctx = call.request, call.state, call.ctx
    key = idempotency.key_from(request)
    if key is None:
        return None
    digest = await state.intake.run(ctx.org_id, idempotency.digest_of, api, body)
    got = await idempotency.begin(
        state.sessions.kw["bind"],
        ctx,
        key,
        digest,
        call.rid,
        state.settings.upstream_timeout_s,
        request.is_disconnected,
        lease_s=state.settings.idempotency_lease_s,
        bill_cut=state.bill,
    )
    if isinstance(got, idempotency.Recorded):
        return got.response()
    return got


def _id(prefix: str, rid: str) -> str:
    return f"{prefix}-{rid.removeprefix('req_')}"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
