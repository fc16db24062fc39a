"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import MetricsDep, SchedulerDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(scheduler: SchedulerDep) -> JSONResponse:
    """Alive while the scheduler loop runs; a dead loop needs a restart."""
    ok = scheduler.alive
    return JSONResponse({"status": "ok" if ok else "scheduler loop stopped"}, 200 if ok else 503)


@router.get("/readyz")
async def readyz(scheduler: SchedulerDep) -> JSONResponse:
    """Ready to take traffic: the engine is loaded and the queue has room."""
    ready = scheduler.alive and len(scheduler.waiting) < scheduler.settings.max_waiting
    body = {"status": "ready" if ready else "not ready", "epoch": scheduler.epoch}
    return JSONResponse(body, 200 if ready else 503)


@router.get("/metrics")
async def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
