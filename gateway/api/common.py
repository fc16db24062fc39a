"""What the API routes share around a generation: the body's declared size, the
intake's refusal, alias resolution, the replica's text as content and tool calls, and
a client that went away."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from cachepoint.gateway.contract import toolcalls
from cachepoint.gateway.errors import ApiError, error_body, rate_limited
from cachepoint.gateway.schemas.messages import (
    CountTokensRequest,
    MessagesRequest,
    TextOut,
    ToolUseOut,
)
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy import aliases
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
