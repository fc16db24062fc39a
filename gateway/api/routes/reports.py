"""The Admin API's usage and cost reports, scoped to the admin key's org."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.api.deps import AdminCallerDep, StateDep
from cachepoint.gateway.billing.reports import (
    COST_GROUPS,
    USAGE_GROUPS,
    WIDTHS,
    ReportError,
    ReportQuery,
    cost_report,
    parse_query,
    usage_report,
)
from cachepoint.gateway.errors import invalid
from cachepoint.gateway.state import GatewayState

router = APIRouter(prefix="/v1/organizations", tags=["reports"])


async def _report(
    request: Request,
    state: GatewayState,
    org_id: str,
    groups: set[str],
    build: Callable[[Session, ReportQuery], dict[str, Any]],
) -> dict[str, Any]:
    try:
        q = parse_query(org_id, request.query_params.multi_items(), groups, WIDTHS)
    except ReportError as exc:
        raise invalid(str(exc)) from exc

    def run() -> dict[str, Any]:
        with state.sessions() as session:
            return build(session, q)

    return await run_in_threadpool(run)


@router.get("/usage_report/messages")
async def messages_usage(request: Request, state: StateDep, ctx: AdminCallerDep) -> Any:
    return await _report(request, state, ctx.org_id, USAGE_GROUPS, usage_report)


@router.get("/cost_report")
async def cost(request: Request, state: StateDep, ctx: AdminCallerDep) -> Any:
    return await _report(
        request, state, ctx.org_id, COST_GROUPS, lambda s, q: cost_report(s, q, state.price)
    )
