"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ...scheduler import Scheduler
from ..deps import MetricsDep, SchedulerDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(scheduler: SchedulerDep) -> JSONResponse:
    """Alive while the scheduler loop runs; a dead loop needs a restart."""
    ok = scheduler.alive
    return JSONResponse({"status": "ok" if ok else "scheduler loop stopped"}, 200 if ok else 503)


def _not_ready_reason(scheduler: Scheduler) -> str | None:
    if scheduler.failure is not None:
        exc = scheduler.failure
        return f"scheduler loop died ({type(exc).__name__}: {exc}); the process is exiting"
    if not scheduler.alive:
        return "scheduler loop stopped"
    if len(scheduler.waiting) >= scheduler.settings.max_waiting:
        return "waiting queue is full"
    return None


@router.get("/readyz")
async def readyz(scheduler: SchedulerDep) -> JSONResponse:
    """Ready to take traffic: the scheduler loop runs and the queue has room. A dead
    loop fails this at once, before the process exits (issue 12)."""
    reason = _not_ready_reason(scheduler)
    body: dict[str, object] = {"status": "ready" if reason is None else "not ready"}
    body["epoch"] = scheduler.epoch
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, 200 if reason is None else 503)


@router.get("/metrics")
async def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
