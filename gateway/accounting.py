"""From a finished (or cut short) generation to one ledger row, traced."""

from __future__ import annotations

import anyio
from opentelemetry import trace
from opentelemetry.trace import Span
from starlette.concurrency import run_in_threadpool

from .contract.billing import Buckets
from .ledger import Charge
from .pipeline import Prepared
from .schemas.messages import MessagesRequest
from .state import GatewayState
from .tenants import KeyContext
from .tracing import usage_attributes


def charge_of(
    rid: str, ctx: KeyContext, req: MessagesRequest, replica: str, p: Prepared, b: Buckets
) -> Charge:
    return Charge(
        rid, ctx.org_id, ctx.workspace_id, ctx.key_id, req.model, replica, p.plan.scope, b
    )


async def bill(state: GatewayState, charge: Charge, parent: Span | None = None) -> None:
    """Write the usage row (idempotent by request id).

    NOTE: shielded, because the callers that matter most run while being cancelled: a
    stream whose client hung up, or a generation stopped for the same reason. The
    write must still happen, and it must not block the event loop.
    """
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    server = parent or trace.get_current_span()
    with anyio.CancelScope(shield=True):
        with state.tracer.start_as_current_span("bill", context=ctx) as span:
            cost = await run_in_threadpool(state.bill, charge)
            span.set_attribute("cachepoint.ledger.inserted", cost is not None)
            span.set_attributes(usage_attributes(charge.buckets, cost))
            server.set_attributes(usage_attributes(charge.buckets))
