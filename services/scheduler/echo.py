"""An instant replica with no model: for measuring the gateway alone, and for tests.

It speaks the replica API (/v1/generate, streaming too, /v1/stats, /healthz, /readyz) and
answers at once, reporting the whole prompt as computed and every breakpoint as a
5m write. ``fail_with`` makes every generate answer that HTTP status instead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .model_source import RANDOM_MODEL_NAME

_ERRORS = {
    400: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def create_echo_app(
    name: str = "echo",
    fail_with: int | None = None,
    output_tokens: int = 1,
    model: str = RANDOM_MODEL_NAME,
) -> FastAPI:
    """``model``: the model it says it serves; the gateway routes only that model's
    requests here (the gateway's default model, as a real random-weight replica)."""
    app = FastAPI(title=f"echo replica {name}")

    def result(body: dict[str, Any]) -> dict[str, Any]:
        n = len(body["token_ids"])
        last = max((bp["position"] for bp in body.get("breakpoints", [])), default=0)
        return {
            "request_id": body.get("request_id") or "echo",
            "replica": name,
            "epoch": 1,
            "model": model,
            "output_token_ids": [0] * output_tokens,
            "text": "x" * output_tokens,
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "output_tokens": output_tokens,
            "cache": {
                "prompt_tokens": n,
                "engine_hit_tokens": 0,
                "computed_tokens": n,
                "entry_hit_tokens": 0,
                "entry_hit_lookback": None,
                "written_5m_tokens": last,
                "written_1h_tokens": 0,
                "retention_refused": False,
                "refusal_reason": None,
            },
            "timings": {"queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "ttft_s": 0.0},
        }

    @app.post("/v1/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        if fail_with is not None:
            kind = _ERRORS.get(fail_with, "api_error")
            msg = f"echo replica configured to answer {fail_with}"
            return JSONResponse(
                {"type": "error", "error": {"type": kind, "message": msg}}, fail_with
            )
        res = result(body)
        if not body.get("stream"):
            return res

        async def lines() -> AsyncIterator[bytes]:
            yield (json.dumps({"type": "prefill_done", "cache": res["cache"]}) + "\n").encode()
            for t in res["output_token_ids"]:
                yield (json.dumps({"type": "token", "token_id": t, "text": "x"}) + "\n").encode()
            yield (json.dumps({"type": "done", "response": res}) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return {
            "replica": name,
            "epoch": 1,
            "model": model,
            "block_size": 16,
            "queued_prefill_tokens": 0,
            "running": 0,
            "waiting": 0,
            "max_waiting": 1_000_000,
        }

    # NOTE: the gateway polls /readyz and takes a replica that fails it out of routing.
    @app.get("/healthz")
    @app.get("/readyz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
