"""How a request ends on either engine, once its core has let go of it, and the
response a finished one gets."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cachepoint.protocol import GenerateResponse, Timings
from cachepoint.replica.request_state import SeqStatus
from cachepoint.replica.sequence import SequenceState

log = logging.getLogger(__name__)


def end_request(
    seq: SequenceState,
    error: Exception | None,
    *,
    ids: set[str],
    on_finish: Callable[[SequenceState], None] | None,
) -> None:
    """``seq`` is finished (failed with ``error``, if any): close its stream, resolve
    its future, free its request id (``ids``: those running on the replica), and tell
    ``on_finish`` (metrics, the request log)."""
    seq.status = SeqStatus.FINISHED
    seq.t_end = time.perf_counter()
    ids.discard(seq.request_id)
    seq.stream.put_nowait(None)
    if not seq.done.done():
        if error is None:
            seq.done.set_result(None)
        else:
            seq.done.set_exception(error)
            seq.done.exception()  # mark retrieved: a vanished client may never await it
    if on_finish is not None:
        try:
            on_finish(seq)
        except Exception:  # metrics and logs must never fail a request or the loop
            log.exception("on_finish hook failed for %s", seq.request_id)


def response(seq: SequenceState, *, replica: str, epoch: int, model: str) -> GenerateResponse:
    """The response of a request that finished without an error."""
    assert seq.cache is not None
    assert seq.stop_reason is not None
    t_first = seq.t_first or seq.t_end
    return GenerateResponse(
        request_id=seq.request_id,
        replica=replica,
        epoch=epoch,
        model=model,
        output_token_ids=seq.output,
        text=seq.stopper.text,
        stop_reason=seq.stop_reason,  # type: ignore[arg-type]
        stop_sequence=seq.stopper.stopped_on,
        output_tokens=len(seq.output),
        cache=seq.cache,
        timings=Timings(
            queue_s=seq.t_admit - seq.t_submit,
            prefill_s=t_first - seq.t_admit,
            decode_s=seq.t_end - t_first,
            ttft_s=t_first - seq.t_submit,
            decode_mixed_s=seq.decode_mixed_s,
            preemptions=seq.preemptions,
        ),
    )
