"""POST /v1/drain: stop taking requests and wait for the running ones (draining.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from cachepoint.replica.api.deps import require_internal_token
from cachepoint.replica.draining import Drainer
from cachepoint.replica.schemas import DrainRequest, DrainResponse

router = APIRouter(tags=["drain"], dependencies=[Depends(require_internal_token)])


@router.post("/v1/drain", response_model=DrainResponse)
async def drain(body: DrainRequest, request: Request) -> DrainResponse:
    """Mark the replica draining (for good: it never takes requests again in this
    process), publish a heartbeat that says so, and answer once nothing is in flight or
    ``timeout_s`` has passed. The pod's preStop hook calls this before its SIGTERM."""
    drainer: Drainer = request.app.state.drainer
    result = await drainer.drain(body.timeout_s, why="POST /v1/drain")
    return DrainResponse(drained=result.drained, in_flight=result.in_flight)
