"""What the API routes share around a generation: the body's declared size, the
intake's refusal, alias resolution, cache diagnostics against the turn before, the
replica's text as content and tool calls, and a client that went away."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.contract import toolcalls
from cachepoint.gateway.diagnostics import Diagnosed
from cachepoint.gateway.errors import ApiError, error_body, rate_limited
from cachepoint.gateway.pipeline import Prepared
from cachepoint.gateway.schemas.messages import (
    CountTokensRequest,
    MessagesRequest,
    TextOut,
    ToolUseOut,
)
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy import aliases
from cachepoint.gateway.tenancy.tenants import KeyContext
from cachepoint.protocol import GenerateResponse

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", MessagesRequest, CountTokensRequest)


async def resolved(state: GatewayState, body: _Body) -> _Body:
    """The request with its model resolved to a served id (aliases), or a 404.

    NOTE: routing, the cache key, profiles, the answer's ``model`` and the ledger all
    use the served id, as Anthropic answers an alias with the snapshot it resolved to:
    one served model has one cache whatever name reached it. The ledger keeps the
    client's name too (``requested_model``)."""
    served = await aliases.resolve(state, body.model)
    return body if served == body.model else body.model_copy(update={"model": served})


def declared(request: Request, state: GatewayState) -> int:
    """The body size a request declares; without a content-length, the most it may be."""
    raw = request.headers.get("content-length", "")
    return int(raw) if raw.isdigit() else state.settings.max_body_bytes


def intake_full(state: GatewayState) -> ApiError:
    state.metrics.intake_refused.inc()
    return rate_limited(
        "too many of your organization's request bodies are being read and rendered at "
        "once (intake_org_bytes); retry shortly"
    )


def answer(
    body: MessagesRequest, result: GenerateResponse, forced: toolcalls.Forcing
) -> tuple[list[Any], Any, Any]:
    """The replica's text as content blocks, its tool calls as ``tool_use`` blocks."""
    text, stop_reason, stop_sequence = forced.settle(
        result.text, result.stop_reason, result.stop_sequence
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


def client_gone(
    state: GatewayState, rid: str, when: str, path: str = "/v1/messages"
) -> JSONResponse:
    log.info("request %s: client went away %s", rid, when)
    state.metrics.requests.labels("client_gone").inc()
    status, body = error_body(path, 499, "api_error", "client disconnected", rid, None)
    return JSONResponse(body, status)


async def diagnose_turn(
    state: GatewayState,
    ctx: KeyContext,
    rid: str,
    prepared: Prepared,
    *,
    opted_in: bool,
    previous_id: str | None,
    session_id: str | None,
) -> Prepared:
    """Compare the fingerprint with the turn before, and keep it for the turns after:
    the answer for a client that opted in, the reason for the ledger, the trace and the
    metric. Memory answers most turns; the database (a worker thread) the turns this
    gateway did not see. Diagnostics never fails a request: an error here answers
    ``unavailable``, as Anthropic's does when it has no diagnosis."""
    fp = prepared.fingerprint
    assert fp is not None
    prints = state.fingerprints
    ask = {
        "org_id": ctx.org_id,
        "workspace_id": ctx.workspace_id,
        "fp": fp,
        "opted_in": opted_in,
        "previous_id": previous_id,
        "session_id": session_id,
        "api_key_id": ctx.key_id,
    }
    try:
        d = prints.diagnose_recent(**ask)
        if d is None:
            d = await run_in_threadpool(lambda: prints.diagnose(**ask))
    except Exception as exc:
        log.warning("request %s: cache diagnostics failed: %r", rid, exc)
        unavailable = {"cache_miss_reason": {"type": "unavailable"}}
        d = Diagnosed(unavailable if previous_id else None, "unavailable", None)
    # NOTE: kept after the comparison (a turn is never compared with itself); its row
    # is written with its ledger row (GatewayState.bill).
    prints.remember(
        f"msg_{rid.removeprefix('req_')}", ctx.org_id, ctx.workspace_id, session_id, ctx.key_id, fp
    )
    # NOTE: the reason is final at billing (`charge_of`), where what happened to the
    # cache is known; it is counted and traced there.
    who = replace(prepared.who, miss_reason=d.reason, miss_tokens=d.missed_tokens)
    return replace(prepared, diagnosis=d.answer, who=who, previous=d.previous)
