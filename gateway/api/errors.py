"""Exception handlers: every failure becomes its API's error envelope (Anthropic's, or
OpenAI's on the OpenAI-compatible endpoints), never a trace."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachepoint.gateway.errors import ApiError, error_body

log = logging.getLogger(__name__)

_UNION_TAGS = {"text", "image", "document", "tool_use", "tool_result", "thinking"}
_UNION_TAGS |= {"redacted_thinking", "base64", "url", "content", "str", "function-after"}


def clean_loc(loc: tuple[Any, ...]) -> str:
    """('body', 'messages', 3, 'list[...]', 1, 'text', 'cache_control') ->
    'messages.3.content.1.cache_control': drop pydantic's union branch names."""
    out: list[str] = []
    prev_int = False
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out.append(str(part))
            prev_int = True
            continue
        text = str(part)
        if "[" in text or "(" in text or (prev_int and text in _UNION_TAGS) or text in ("str",):
            prev_int = False
            continue
        out.append(text)
        prev_int = False
    return ".".join(out)


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            return "request body is not valid JSON"
    messages: list[str] = []
    for err in errors[:5]:
        path = clean_loc(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "Extra inputs are not permitted"
        messages.append(f"{path}: {msg}" if path else msg)
    return "; ".join(dict.fromkeys(messages))


def _rid(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def _reply(request: Request, status: int, kind: str, message: str, param: str | None = None):
    status, body = error_body(request.url.path, status, kind, message, _rid(request), param)
    return JSONResponse(body, status)


def _param(exc: RequestValidationError) -> str | None:
    """The parameter the first validation error is about (OpenAI's ``param``)."""
    for err in exc.errors()[:1]:
        path = clean_loc(tuple(err.get("loc", ())))
        return path or None
    return None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return _reply(request, exc.status, exc.kind, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _validation_message(exc)
        return _reply(request, 400, "invalid_request_error", message, _param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        kind = kinds.get(exc.status_code, "invalid_request_error")
        msg = "not found" if exc.status_code == 404 else str(exc.detail)
        return _reply(request, exc.status_code, kind, msg)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _reply(request, 500, "api_error", "internal error")
