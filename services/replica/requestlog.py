"""One structured line per finished request in the replica's log.

The scheduler calls :class:`RequestLog` from its ``on_finish`` hook on the event-loop
thread, so it only builds a flat dict; the formatter (``cachepoint.runtime.serve``) turns it
into one JSON line on stderr.
"""

from __future__ import annotations

import logging

from opentelemetry import trace

from cachepoint.replica.errors import CancelledRequestError, SchedulerError
from cachepoint.replica.sequence import SequenceState

# NOTE: lifecycle and request lines live under this name, which the CLI keeps at INFO
# whatever --log-level says: they are the record of what the replica did, not chatter.
LOGGER = "cachepoint.replica"
log = logging.getLogger(f"{LOGGER}.requests")


def _seconds(x: float) -> float:
    return round(max(x, 0.0), 6)


def request_fields(seq: SequenceState, replica: str) -> dict[str, object]:
    """The line's content: outcome, the cache buckets, output tokens and timings.

    The cache fields are 0 when the prefill never committed: nothing was read or
    written for the request then, and nothing is billed for it.
    """
    error: BaseException | None = None
    if seq.done.done() and not seq.done.cancelled():
        error = seq.done.exception()
    if error is None:
        status = "ok"
    elif isinstance(error, CancelledRequestError):
        status = "cancelled"
    else:
        status = "error"
    cache = seq.cache
    t_admit = seq.t_admit or seq.t_end  # never admitted: all of it was queueing
    t_first = seq.t_first or seq.t_end
    fields: dict[str, object] = {
        "event": "request",
        "replica": replica,
        "request_id": seq.request_id,
        "status": status,
        "stop_reason": seq.stop_reason,
        "error_type": (error.kind if isinstance(error, SchedulerError) else type(error).__name__)
        if error is not None
        else None,
        "error": str(error)[:500] if error is not None else None,
        "prompt_tokens": seq.prompt_len,
        "engine_hit_tokens": cache.engine_hit_tokens if cache else 0,
        "entry_hit_tokens": cache.entry_hit_tokens if cache else 0,
        "written_5m_tokens": cache.written_5m_tokens if cache else 0,
        "written_1h_tokens": cache.written_1h_tokens if cache else 0,
        "output_tokens": len(seq.output),
        "queue_s": _seconds(t_admit - seq.t_submit),
        "prefill_s": _seconds(t_first - t_admit),
        "decode_s": _seconds(seq.t_end - t_first),
    }
    ctx = trace.get_current_span(seq.otel_ctx).get_span_context() if seq.otel_ctx else None
    if ctx is not None and ctx.is_valid:
        fields["trace_id"] = format(ctx.trace_id, "032x")
    return fields


class RequestLog:
    """The ``on_finish`` hook that writes the line."""

    def __init__(self, replica: str) -> None:
        self.replica = replica  # the replica's name, on every line

    def __call__(self, seq: SequenceState) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("request", extra={"fields": request_fields(seq, self.replica)})
