"""A request's spans on either engine: `admit`, `prefill` (or `recompute`), `decode`.

Both cores open and close them alike; what differs is the prefill span's attributes,
which each passes in as a function of the sequence (called only while the span is open).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from cachepoint.replica.errors import CancelledRequestError
from cachepoint.replica.sequence import SequenceState

log = logging.getLogger(__name__)

Attributes = Mapping[str, AttributeValue]
PrefillAttributes = Callable[[SequenceState], Attributes]


def trace_admission(tracer: trace.Tracer, seq: SequenceState, attributes: Attributes) -> None:
    """The `admit` span, from submission until now, then the `prefill` span opened."""
    admit = tracer.start_span("admit", context=seq.otel_ctx, start_time=seq.t_submit_ns)
    admit.set_attributes(attributes)
    admit.end()
    seq.prefill_span = tracer.start_span("prefill", context=seq.otel_ctx)


def open_decode(tracer: trace.Tracer, seq: SequenceState) -> None:
    """The `decode` span: from the first token to the end."""
    seq.decode_span = tracer.start_span("decode", context=seq.otel_ctx)


def end_prefill(
    seq: SequenceState,
    attributes: PrefillAttributes,
    error: Exception | None = None,
    *,
    preempted: bool = False,
) -> None:
    """End the prefill span, if one is open: committed, aborted by ``error``, or cut
    short by a preemption."""
    span, seq.prefill_span = seq.prefill_span, None
    if span is None:
        return
    span.set_attributes(attributes(seq))
    if preempted:
        span.set_attribute("cachepoint.preempted", True)
    if error is not None:
        span.set_attribute("cachepoint.aborted", True)
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def close(seq: SequenceState, error: Exception | None, attributes: PrefillAttributes) -> None:
    """The request ended (``error`` if it failed): end whatever span is still open."""
    try:
        end_prefill(seq, attributes, error or CancelledRequestError("finished before commit"))
        if seq.decode_span is not None:
            seq.decode_span.set_attribute("gen_ai.usage.output_tokens", len(seq.output))
            seq.decode_span.set_attribute("cachepoint.decode.mixed_s", seq.decode_mixed_s)
            if error is not None:
                seq.decode_span.record_exception(error)
                seq.decode_span.set_status(Status(StatusCode.ERROR, str(error)))
            seq.decode_span.end()
            seq.decode_span = None
    except Exception:  # tracing must never keep a request from ending
        log.exception("closing the spans of %s failed", seq.request_id)
