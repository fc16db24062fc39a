"""One JSON line per Messages request on the ``cachepoint.requests`` logger.

The middleware opens a record when a request arrives and writes it when the response
has left (for a stream, after its last event). What the gateway learns on the way is
noted on the record through a context variable, so the code that knows it (the route
for the caller and model, billing for the buckets and the replica) needs no handle on
the request: the route's task, its stream and billing's worker threads all see the
context the middleware set.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

from cachepoint.billing import Buckets
from cachepoint.gateway.billing.ledger import Charge
from cachepoint.gateway.tenancy.tenants import KeyContext

LOGGER = "cachepoint.requests"
LOGGED_PATHS = frozenset(
    {"/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/completions"}
)

log = logging.getLogger(LOGGER)


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # the request-id header's value
    path: str  # /v1/messages or /v1/messages/count_tokens
    started: float  # monotonic time the request arrived
    org: str | None = None  # the caller's org id, once authenticated
    key_id: str | None = None  # the API key's id (never the key)
    model: str | None = None  # as the client named it
    stream: bool | None = None  # the request's stream flag
    replica: str | None = None  # the replica that served it, once billed
    status: int | None = None  # the HTTP status sent
    error_type: str | None = None  # the Anthropic error type, HTTP or SSE, if any
    buckets: Buckets | None = None  # what was billed; None = nothing

    def fields(self, now: float) -> dict[str, Any]:
        b = self.buckets
        return {
            "request_id": self.request_id,
            "path": self.path,
            "org": self.org,
            "key_id": self.key_id,
            "model": self.model,
            "stream": self.stream,
            "replica": self.replica,
            "status": self.status,
            "error_type": self.error_type,
            "input_tokens": b.input_tokens if b else None,
            "cache_read_input_tokens": b.cache_read_input_tokens if b else None,
            "cache_write_5m_tokens": b.cache_write_5m_tokens if b else None,
            "cache_write_1h_tokens": b.cache_write_1h_tokens if b else None,
            "output_tokens": b.output_tokens if b else None,
            "latency_ms": round((now - self.started) * 1000, 2),
        }


_current: ContextVar[RequestRecord | None] = ContextVar("cachepoint_request", default=None)


def begin(request_id: str, path: str) -> tuple[RequestRecord, Token[RequestRecord | None]]:
    record = RequestRecord(request_id, path, time.monotonic())
    return record, _current.set(record)


def finish(record: RequestRecord, token: Token[RequestRecord | None]) -> None:
    _current.reset(token)
    if log.isEnabledFor(logging.INFO):
        # NOTE: formatted by the process's handler (cachepoint.runtime.serve.JsonFormatter: ts,
        # level, logger, msg, then these fields), like the replica's request lines.
        log.info("request", extra={"fields": record.fields(time.monotonic())})


def note_caller(ctx: KeyContext) -> None:
    record = _current.get()
    if record is not None:
        record.org, record.key_id = ctx.org_id, ctx.key_id


def note_request(ctx: KeyContext, model: str, stream: bool) -> None:
    """The route, once it knows who called and for what."""
    record = _current.get()
    if record is not None:
        record.org, record.key_id = ctx.org_id, ctx.key_id
        record.model, record.stream = model, stream


def note_charge(charge: Charge) -> None:
    """Billing, for the buckets and the replica that the ledger row holds."""
    record = _current.get()
    if record is not None:
        record.buckets = charge.buckets
        record.replica = charge.replica


def always_log() -> None:
    """Write the request lines whatever the process's log level (the gateway command
    calls this; the embedded stack keeps its stderr in gateway.log)."""
    log.setLevel(logging.INFO)
