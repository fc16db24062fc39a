"""The Admin API's usage and cost reports, scoped to the admin key's org."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from ...errors import invalid
from ...reports import (
    COST_GROUPS,
    USAGE_GROUPS,
    WIDTHS,
    ReportError,
    cost_report,
    parse_query,
    usage_report,
)
from ..deps import AdminCallerDep, StateDep

router = APIRouter(prefix="/v1/organizations", tags=["reports"])


@router.get("/usage_report/messages")
async def messages_usage(request: Request, state: StateDep, ctx: AdminCallerDep) -> Any:
    try:
        q = parse_query(ctx.org_id, request.query_params.multi_items(), USAGE_GROUPS, WIDTHS)
    except ReportError as exc:
        raise invalid(str(exc)) from exc

    def run() -> dict[str, Any]:
        with state.sessions() as session:
            return usage_report(session, q)

    return await run_in_threadpool(run)


@router.get("/cost_report")
async def cost(request: Request, state: StateDep, ctx: AdminCallerDep) -> Any:
    try:
        q = parse_query(ctx.org_id, request.query_params.multi_items(), COST_GROUPS, WIDTHS)
    except ReportError as exc:
        raise invalid(str(exc)) from exc

    def run() -> dict[str, Any]:
        with state.sessions() as session:
            return cost_report(session, q, state.price)

    return await run_in_threadpool(run)
