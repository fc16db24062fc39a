"""Every failure leaves as one JSON envelope: {"type": "error", "error": {type, message}}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachepoint.protocol import ErrorEvent
from cachepoint.replica.errors import QueueFullError, SchedulerError


def error_body(kind: str, message: str) -> dict[str, object]:
    # NOTE: the protocol's error event is also the body of every error answer, so the
    # gateway reads a refused call and a stream that failed with the same type.
    return ErrorEvent.of(kind, message).model_dump()


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            pos = err.get("loc", ("body", "?"))[-1]
            parts.append(f"body is not valid JSON (at character {pos})")
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            error_body("invalid_request_error", _validation_message(exc)), status_code=400
        )

    @app.exception_handler(SchedulerError)
    async def _scheduler(_: Request, exc: SchedulerError) -> JSONResponse:
        headers = {"retry-after": "1"} if isinstance(exc, QueueFullError) else None
        return JSONResponse(error_body(exc.kind, str(exc)), exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(kind, str(exc.detail)), exc.status_code)
