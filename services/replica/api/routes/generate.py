"""POST /v1/generate: one request through admission, prefill and decode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.responses import StreamingResponse

from cachepoint.protocol import (
    VERSION_HEADER,
    VERSION_MISMATCH_STATUS,
    GenerateRequest,
    GenerateResponse,
    version_mismatch,
)
from cachepoint.protocol import events as wire
from cachepoint.replica.api.deps import SchedulerDep, require_internal_token
from cachepoint.replica.errors import CancelledRequestError, SchedulerError
from cachepoint.replica.interface import ReplicaCore
from cachepoint.replica.sequence import PrefillDone, SequenceState, TokenEvent


def require_protocol(
    version: Annotated[str | None, Header(alias=VERSION_HEADER)] = None,
) -> None:
    """409, naming both versions, when the caller speaks another protocol version (no
    header: this one). NOTE: a dependency, so it answers before the body is validated:
    a body of another version may not validate, and would hide the real cause."""
    message = version_mismatch(version)
    if message is not None:
        raise HTTPException(VERSION_MISMATCH_STATUS, message)


router = APIRouter(
    tags=["generate"],
    dependencies=[Depends(require_internal_token), Depends(require_protocol)],
)

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


async def _stream(
    seq: SequenceState, first: PrefillDone, scheduler: ReplicaCore
) -> AsyncIterator[bytes]:
    try:
        yield wire.encode_event(wire.PrefillDoneEvent(cache=first.cache))
        while (ev := await seq.stream.get()) is not None:
            if isinstance(ev, TokenEvent):
                yield wire.encode_event(wire.TokenEvent(token_id=ev.token_id, text=ev.text))
        try:
            await seq.done
        except SchedulerError as exc:
            yield wire.encode_event(wire.ErrorEvent.of(exc.kind, str(exc)))
        else:
            yield wire.encode_event(wire.DoneEvent(response=scheduler.result(seq)))
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
    """Generate from token ids. With ``stream``, NDJSON lines (cachepoint.protocol's
    events): the prefill's final cache report, then one per token, then the final
    response (or an error)."""
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
