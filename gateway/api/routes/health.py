"""Liveness and readiness. NOTE: /metrics is not served here: its billed figures name
each org, so it has its own listener (``metrics_port``), apart from the public API."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.api.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request, state: StateDep) -> JSONResponse:
    """Ready when the ledger is reachable (reports work without replicas); the body
    says how many replicas routing can use right now."""

    def db_ok() -> bool:
        try:
            with state.sessions() as session:
                session.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    ok = await run_in_threadpool(db_ok)
    views = request.app.state.directory.views()
    body = {
        "status": "ready" if ok else "database unreachable",
        "replicas_known": len(views),
        "replicas_live": sum(v.live for v in views),
        "event_plane": "connected" if request.app.state.bus.connected else "down",
    }
    return JSONResponse(body, 200 if ok else 503)
