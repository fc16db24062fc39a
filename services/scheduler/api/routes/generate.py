"""POST /v1/generate: one request through admission, prefill and decode."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ...core import ReplicaCore
from ...errors import CancelledRequestError, SchedulerError
from ...schemas import GenerateRequest, GenerateResponse
from ...sequence import PrefillDone, SequenceState, TokenEvent
from ..deps import SchedulerDep, require_internal_token
from ..errors import error_body

router = APIRouter(tags=["generate"], dependencies=[Depends(require_internal_token)])

_DISCONNECT_POLL_S = 0.2


async def _until(
    aw: asyncio.Future[object], seq: SequenceState, request: Request, scheduler: ReplicaCore
) -> object:
    """Await ``aw``; if the client disconnects first, abort the request."""
    try:
        while True:
            done, _ = await asyncio.wait({aw}, timeout=_DISCONNECT_POLL_S)
            if done:
                return aw.result()
            if await request.is_disconnected():
                scheduler.cancel(seq)
                raise CancelledRequestError("client disconnected")
    except asyncio.CancelledError:
        scheduler.cancel(seq)
        raise
    finally:
        if not aw.done():
            aw.cancel()


def _line(obj: object) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


async def _stream(
    seq: SequenceState, first: PrefillDone, scheduler: ReplicaCore
) -> AsyncIterator[bytes]:
    try:
        yield _line({"type": "prefill_done", "cache": first.cache.model_dump()})
        while (ev := await seq.stream.get()) is not None:
            if isinstance(ev, TokenEvent):
                yield _line({"type": "token", "token_id": ev.token_id, "text": ev.text})
        try:
            await seq.done
        except SchedulerError as exc:
            yield _line(error_body(exc.kind, str(exc)))
        else:
            yield _line({"type": "done", "response": scheduler.result(seq).model_dump()})
    finally:
        scheduler.cancel(seq)  # a no-op once finished; aborts if the client went away


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def generate(
    body: GenerateRequest, request: Request, scheduler: SchedulerDep
) -> GenerateResponse | StreamingResponse:
    """Generate from token ids. With ``stream``, NDJSON lines: ``prefill_done`` (the
    final cache report), then ``token`` lines, then ``done`` (or ``error``)."""
    seq = scheduler.submit(body)
    if not body.stream:
        await _until(asyncio.ensure_future(seq.done), seq, request, scheduler)
        return scheduler.result(seq)
    # Wait for the prefill before answering, so its failures are real HTTP errors.
    first = await _until(asyncio.ensure_future(seq.stream.get()), seq, request, scheduler)
    if first is None:
        await seq.done  # raises the request's error
    assert isinstance(first, PrefillDone)
    return StreamingResponse(_stream(seq, first, scheduler), media_type="application/x-ndjson")
