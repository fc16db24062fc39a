"""An instant replica with no model: for measuring the gateway alone, and for tests.

It speaks the replica API (/v1/generate, streaming too, /v1/stats, /healthz, /readyz)
in cachepoint.protocol's types and answers at once, reporting the whole prompt as
computed and every breakpoint as a 5m write. ``fail_with`` makes every generate answer
that HTTP status instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cachepoint.protocol import (
    VERSION_HEADER,
    VERSION_MISMATCH_STATUS,
    BlockStats,
    CacheReport,
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    GenerateResponse,
    PrefillDoneEvent,
    StatsResponse,
    Timings,
    TokenEvent,
    encode_event,
    version_mismatch,
)
from cachepoint.replica.model_source import RANDOM_MODEL_NAME

_ERRORS = {
    400: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_BLOCK_SIZE = 16  # what it reports; nothing is cached, so nothing depends on it
_MAX_WAITING = 1_000_000  # it never queues


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(ErrorEvent.of(kind, message).model_dump(), status)


def create_echo_app(
    name: str = "echo",
    fail_with: int | None = None,
    output_tokens: int = 1,
    model: str = RANDOM_MODEL_NAME,
) -> FastAPI:
    """``model``: the model it says it serves; the gateway routes only that model's
    requests here (the gateway's default model, as a real random-weight replica)."""
    app = FastAPI(title=f"echo replica {name}")

    def result(body: GenerateRequest) -> GenerateResponse:
        n = len(body.token_ids)
        last = max((bp.position for bp in body.breakpoints), default=0)
        return GenerateResponse(
            request_id=body.request_id or "echo",
            replica=name,
            epoch=1,
            model=model,
            output_token_ids=[0] * output_tokens,
            text="x" * output_tokens,
            stop_reason="max_tokens",
            stop_sequence=None,
            output_tokens=output_tokens,
            cache=CacheReport(
                prompt_tokens=n,
                engine_hit_tokens=0,
                computed_tokens=n,
                entry_hit_tokens=0,
                entry_hit_lookback=None,
                written_5m_tokens=last,
                written_1h_tokens=0,
                retention_refused=False,
                refusal_reason=None,
            ),
            timings=Timings(queue_s=0.0, prefill_s=0.0, decode_s=0.0, ttft_s=0.0),
        )

    # NOTE: the body is read by hand, not as a GenerateRequest parameter: ``fail_with``
    # answers before any validation, as a replica that fails whatever it is sent.
    @app.post("/v1/generate")
    async def generate(
        request: Request,
        version: Annotated[str | None, Header(alias=VERSION_HEADER)] = None,
    ) -> Response:
        mismatch = version_mismatch(version)
        if mismatch is not None:
            return _error(VERSION_MISMATCH_STATUS, "invalid_request_error", mismatch)
        if fail_with is not None:
            kind = _ERRORS.get(fail_with, "api_error")
            return _error(fail_with, kind, f"echo replica configured to answer {fail_with}")
        try:
            body = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _error(400, "invalid_request_error", str(exc))
        res = result(body)
        if not body.stream:
            return Response(res.model_dump_json(), media_type="application/json")

        async def lines() -> AsyncIterator[bytes]:
            yield encode_event(PrefillDoneEvent(cache=res.cache))
            for t in res.output_token_ids:
                yield encode_event(TokenEvent(token_id=t, text="x"))
            yield encode_event(DoneEvent(response=res))

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return StatsResponse(
            replica=name,
            epoch=1,
            model=model,
            block_size=_BLOCK_SIZE,
            max_model_len=0,  # no model: no window to report
            blocks=BlockStats(
                total=0, active=0, cached_free=0, empty=0, retained=0, max_retained=0
            ),
            entries=0,
            query_tokens=0,
            hit_tokens=0,
            hit_rate=0.0,
            evictions=0,
            retain_refusals=0,
            waiting=0,
            running=0,
            queued_prefill_tokens=0,
            max_waiting=_MAX_WAITING,
        ).model_dump()

    # NOTE: the gateway polls /readyz and takes a replica that fails it out of routing.
    @app.get("/healthz")
    @app.get("/readyz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
