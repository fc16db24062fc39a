"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cachepoint.replica.api.deps import MetricsDep, SchedulerDep
from cachepoint.replica.interface import ReplicaCore

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(scheduler: SchedulerDep) -> JSONResponse:
    """Alive while the scheduler loop runs; a dead loop needs a restart."""
    ok = scheduler.alive
    return JSONResponse({"status": "ok" if ok else "scheduler loop stopped"}, 200 if ok else 503)


def _not_ready_reason(scheduler: ReplicaCore | None) -> str | None:
    # NOTE: readiness is "loaded and serving", never load: a full queue answers 429 and
    # shows in the heartbeats' waiting/max_waiting, which the gateway routes by. A probe
    # that failed on load took every busy pod out at once in a rolling update, and one
    # with max_waiting 0 never became ready.
    if scheduler is None:
        return "engine loading"
    if scheduler.failure is not None:
        exc = scheduler.failure
        return f"scheduler loop died ({type(exc).__name__}: {exc}); the process is exiting"
    if not scheduler.alive:
        return "scheduler loop stopped"
    if scheduler.unavailable is not None:
        return scheduler.unavailable
    if scheduler.draining:
        return "draining: the replica is going away and takes no new requests"
    return None


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready to take traffic: the engine is loaded, the scheduler loop runs and the
    replica is not draining. A dead loop fails this at once, before the process exits,
    so no traffic reaches it. A full queue does not: overload is the router's business."""
    scheduler: ReplicaCore | None = getattr(request.app.state, "scheduler", None)
    reason = _not_ready_reason(scheduler)
    body: dict[str, object] = {"status": "ready" if reason is None else "not ready"}
    if scheduler is not None:
        body["epoch"] = scheduler.epoch
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, 200 if reason is None else 503)


@router.get("/metrics")
async def metrics(m: MetricsDep) -> Response:
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
