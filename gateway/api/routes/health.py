"""Liveness, readiness and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from ..deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    def db_ok() -> bool:
        try:
            with state.sessions() as session:
                session.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    ok = await run_in_threadpool(db_ok)
    return JSONResponse({"status": "ready" if ok else "database unreachable"}, 200 if ok else 503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
