"""The SSE side of a streamed message: relays the replica's events, bills exactly the
tokens the client was sent, and ends a broken stream with an SSE ``error`` event."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span

from cachepoint.billing import Buckets
from cachepoint.gateway.accounting import bill, charge_for
from cachepoint.gateway.billing.ledger import Charge
from cachepoint.gateway.contract.context_edits import report
from cachepoint.gateway.contract.toolcalls import Part, TextPart, ToolCallParser, offered
from cachepoint.gateway.dispatch import Opened, check_final, error_of, reject_report, stream_broke
from cachepoint.gateway.errors import ApiError, envelope
from cachepoint.gateway.fleet.upstream import ReplicaStreamError, UsageReportError
from cachepoint.gateway.pipeline import Prepared, ReportLimits, buckets_of, check_output, usage_of
from cachepoint.gateway.schemas.messages import MessagesRequest, diagnostics_requested
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy.idempotency import Claim
from cachepoint.gateway.tenancy.tenants import KeyContext
from cachepoint.protocol import CacheReport, DoneEvent, ErrorEvent, GenerateResponse, TokenEvent

log = logging.getLogger(__name__)


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@dataclass(slots=True)
class StreamJob:
    """Everything one streamed message needs after its upstream prefill is done."""

    state: GatewayState  # app state: ledger, router, metrics
    ctx: KeyContext  # who pays
    body: MessagesRequest  # the client's request
    rid: str  # the gateway's request id (the ledger's idempotency key too)
    prepared: Prepared  # rendered prompt and cache plan
    limits: ReportLimits  # what the replica's report must agree with
    opened: Opened  # the upstream stream, past its prefill
    headers: dict[str, str]  # response headers (scope, replica)
    t_start: float  # perf_counter at request start
    t_open: float  # perf_counter when the upstream was opened
    claim: Claim | None  # the idempotency key held, if the client sent one
    server: Span = field(default_factory=trace.get_current_span)  # the request's span
    # how the stream is written: Anthropic's events (None), or another API's (OpenAI's
    # chunks, gateway/streaming_openai.py)
    emitter: Emitter | None = None


@dataclass(slots=True)
class _Progress:
    delivered: int = 0  # tokens whose text has been handed to the client
    pending: int = 0  # tokens received whose text has not gone out yet (empty deltas)
    billed: bool = False  # the ledger row is written, tried, or deliberately skipped
    charged: bool = False  # the full charge is written: the key keeps this stream


class Emitter(Protocol):
    """How a stream is written, event by event: the relay (billing, tool-call parsing,
    progress, errors) is the same for every API."""

    ping: bytes  # what keeps an idle stream open
    tool_calls: int  # tool calls sent so far

    def opening(self, start: Buckets) -> list[bytes]:
        """What goes out once the prefill is done (``start``: its input buckets)."""
        ...

    def part(self, part: Part) -> list[bytes]:
        """Text, or a whole tool call."""
        ...

    def close(self) -> list[bytes]:
        """Close what is open, before the end."""
        ...

    def closing(
        self, stop_reason: str | None, stop_sequence: str | None, b: Buckets
    ) -> list[bytes]:
        """The end: the stop reason and the billed usage."""
        ...

    def error(self, kind: str, message: str) -> bytes:
        """An error after the stream started."""
        ...


@dataclass(slots=True)
class AnthropicEvents:
    """The Messages API's events: message_start, content blocks (text deltas and tool
    calls, indexes in order), message_delta with the usage, message_stop."""

    job: StreamJob  # the stream's request
    tools: bool  # tools were offered: blocks open as the parser finds text or calls
    ping: bytes = b""  # set in __post_init__
    index: int = -1  # the index of the last block started
    text_open: bool = False  # the block at ``index`` is a text block still open
    tool_calls: int = 0  # tool_use blocks sent

    def __post_init__(self) -> None:
        self.ping = PING

    def opening(self, start: Buckets) -> list[bytes]:
        job = self.job
        message: dict[str, Any] = {
            "id": f"msg_{job.rid.removeprefix('req_')}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": job.body.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(start).model_dump(),
        }
        if diagnostics_requested(job.body):
            # NOTE: Anthropic sends diagnostics on message_start only (none later).
            message["diagnostics"] = job.prepared.diagnosis
        out = [sse("message_start", {"type": "message_start", "message": message})]
        if not self.tools:
            # NOTE: without tools the text passes straight through, in one block
            # opened at once; with tools, blocks open as the parser finds text or calls.
            out += self.text("")
        return [*out, PING]

    def text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if not self.text_open:
            self.index, self.text_open = self.index + 1, True
            block = {"type": "text", "text": ""}
            out.append(_event("content_block_start", index=self.index, content_block=block))
        if text:
            delta = {"type": "text_delta", "text": text}
            out.append(_event("content_block_delta", index=self.index, delta=delta))
        return out

    def part(self, part: Part) -> list[bytes]:
        if isinstance(part, TextPart):
            return self.text(part.text)
        out = self.close()
        self.index += 1
        self.tool_calls += 1
        block = {"type": "tool_use", "id": part.id, "name": part.name, "input": {}}
        args = json.dumps(part.input, separators=(",", ":"), ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": args}
        out.append(_event("content_block_start", index=self.index, content_block=block))
        out.append(_event("content_block_delta", index=self.index, delta=delta))
        out.append(_event("content_block_stop", index=self.index))
        return out

    def close(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_event("content_block_stop", index=self.index)]

    def closing(
        self, stop_reason: str | None, stop_sequence: str | None, b: Buckets
    ) -> list[bytes]:
        usage = usage_of(b).model_dump()
        usage.pop("cache_creation")
        delta: dict[str, Any] = {
            "type": "message_delta",
            "delta": {
                "stop_reason": "tool_use" if self.tool_calls else stop_reason,
                "stop_sequence": None if self.tool_calls else stop_sequence,
            },
            "usage": usage,
        }
        edits = report(self.job.prepared.rendered.applied_edits)
        if edits is not None:  # Anthropic: in the final message_delta, when asked for
            delta["context_management"] = edits
        return [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def error(self, kind: str, message: str) -> bytes:
        return sse("error", envelope(kind, message, self.job.rid))


def _track_progress(job: StreamJob, cache: CacheReport, progress: _Progress) -> None:
    """A keyed stream's charge so far (its input buckets, and the output tokens whose
    text went out) is recorded on its idempotency row now and then at most once a
    second: if this gateway dies mid-stream, the retry that takes the key over bills
    the cut attempt from it, at most what was delivered, as a stream cut while this
    gateway lives is billed here."""
    claim = job.claim
    if claim is None:
        return
    replica = job.opened.replica.name

    def so_far() -> Charge:
        b = buckets_of(cache, progress.delivered, job.limits)
        return charge_for(job.state, job.rid, job.ctx, job.body, replica, job.prepared, b)

    claim.track(so_far)


def _event(kind: str, **data: Any) -> bytes:
    return sse(kind, {"type": kind, **data})


def respond(job: StreamJob) -> StreamingResponse:
    if job.emitter is None:
        job.emitter = AnthropicEvents(job, offered(job.body) is not None)
    chunks = _relay(job, job.emitter)
    interval = job.state.settings.sse_ping_interval_s
    body = _with_pings(chunks, interval, job.emitter.ping) if interval > 0 else chunks
    return StreamingResponse(body, media_type="text/event-stream", headers=job.headers)


PING = sse("ping", {"type": "ping"})


async def _with_pings(
    chunks: AsyncIterator[bytes], interval_s: float, ping: bytes = PING
) -> AsyncIterator[bytes]:
    """``chunks``, plus an SSE ``ping`` whenever ``interval_s`` passes with nothing sent
    (a replica slow to prefill, decode or finish), as Anthropic sends them: clients and
    proxies that drop an idle connection keep this one. The SDKs skip pings.

    NOTE: the relay runs in one task of its own for the whole stream (no task per
    chunk) and hands each chunk over, then waits until this side has sent it: the relay
    still resumes after a ``yield`` only once the server took the chunk, which its
    billing counts on, and a wait that times out here never cancels its read of the
    replica (a cancelled read would lose the line it was in)."""
    handoff: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=1)
    sent = asyncio.Event()  # set once the chunk handed over has gone out
    # NOTE: the relay is stopped through an anyio scope, never task.cancel(): its
    # ledger writes shield themselves with anyio, which a native cancel goes through.
    scope = anyio.CancelScope()

    async def pump() -> None:
        with scope:
            end: Exception | None = None
            try:
                async for chunk in chunks:
                    handoff.put_nowait(chunk)  # the queue is empty: the last was taken
                    await sent.wait()
                    sent.clear()
            except Exception as exc:  # the relay's own failure: raised on this side
                end = exc
            finally:
                # NOTE: stopped (the client left) while the relay waits at a yield:
                # closing it runs its finally, which bills what was sent.
                if isinstance(chunks, AsyncGenerator):
                    await chunks.aclose()
            handoff.put_nowait(end)

    task = asyncio.create_task(pump())
    try:
        timeout: float | None = None  # no ping before the first event (message_start)
        while True:
            try:
                async with asyncio.timeout(timeout):
                    item = await handoff.get()
            except TimeoutError:
                yield ping
                continue
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
            sent.set()
            timeout = interval_s
    finally:
        scope.cancel()  # a no-op once the relay ended
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("stream relay failed while closing: %r", task.exception())


async def _relay(job: StreamJob, emit: Emitter) -> AsyncIterator[bytes]:
    state, opened, rid = job.state, job.opened, job.rid
    cache = opened.cache
    now = time.perf_counter()
    state.metrics.ttft.observe(now - job.t_open)
    waited = now - job.t_open  # seconds spent waiting on the replica
    progress = _Progress()
    names = offered(job.body)
    parser = ToolCallParser(names) if names is not None else None
    forced = job.prepared.forcing
    if parser is not None and forced.prefix:
        parser.feed(forced.prefix)  # the open call the prompt already started: nothing out
    recorded: list[bytes] | None = [] if job.claim is not None else None

    async def charge(out_tokens: int) -> bool:
        """Bill once; False when the ledger write failed (logged, one line)."""
        if progress.billed:
            return False
        progress.billed = True
        b = buckets_of(cache, out_tokens, job.limits)
        row = charge_for(state, rid, job.ctx, job.body, opened.replica.name, job.prepared, b)
        try:
            await bill(state, row, job.server)
        except Exception as exc:
            log.warning("stream %s: could not bill %d output tokens: %r", rid, out_tokens, exc)
            return False
        return True

    def out(chunk: bytes) -> bytes:
        if recorded is not None:
            recorded.append(chunk)
        return chunk

    try:
        _track_progress(job, cache, progress)
        for chunk in emit.opening(buckets_of(cache, 0, job.limits)):
            yield out(chunk)
        final: GenerateResponse | None = None
        while final is None:
            t = time.perf_counter()
            try:
                ev = await anext(opened.events)
            except StopAsyncIteration:
                raise ApiError(500, "api_error", "replica stream ended early") from None
            finally:
                waited += time.perf_counter() - t
            if isinstance(ev, TokenEvent):
                progress.pending += 1
                check_output(progress.delivered + progress.pending, job.limits)
                text = ev.text
                parts: list[Part] = []
                if parser is not None:
                    parts = parser.feed(text)
                elif text:
                    parts = [TextPart(text)]
                chunks = [c for part in parts for c in emit.part(part)]
                for chunk in chunks:
                    yield out(chunk)
                if chunks:
                    # NOTE: a generator resumes after `yield` only once the server has
                    # taken the chunk: from here these tokens count as delivered.
                    progress.delivered += progress.pending
                    progress.pending = 0
            elif isinstance(ev, DoneEvent):
                final = check_final(ev, progress.delivered + progress.pending)
            elif isinstance(ev, ErrorEvent):
                raise error_of(ev)
        out_tokens = final.output_tokens
        # The stop string the gateway added is not in the replica's text; the call
        # it closes is.
        closing_text, stop_reason, stop_sequence = forced.settle(
            "", final.stop_reason, final.stop_sequence
        )
        closing_text = closing_text[len(forced.prefix) :]
        tail: list[bytes] = []
        if parser is not None:
            parts = parser.feed(closing_text) + parser.finish()
            tail = [c for part in parts for c in emit.part(part)]
        for chunk in tail + emit.close():
            yield out(chunk)
        # NOTE: billed before the final usage leaves: the request id makes it once only.
        if not await charge(out_tokens):  # logged; the key is released for a retry
            yield emit.error("api_error", "could not record usage")
            return
        # NOTE: recorded before they leave: once the full charge is written, the key
        # keeps this whole stream, so a retry replays it even if this client hangs up
        # before these last events reach it, and is not generated or billed again.
        b = buckets_of(cache, out_tokens, job.limits)
        closing = [out(c) for c in emit.closing(stop_reason, stop_sequence, b)]
        progress.charged = True
        for chunk in closing:
            yield chunk
        metrics = state.metrics
        metrics.upstream_seconds.observe(waited)
        metrics.overhead.observe(time.perf_counter() - job.t_start - waited)
        metrics.requests.labels("ok").inc()
    except UsageReportError as exc:
        # Nothing is billed from a report that cannot be true.
        progress.billed = True
        reject_report(state, opened.replica.name, exc)
        yield emit.error(exc.kind, exc.message)
    except ApiError as exc:
        if isinstance(exc, ReplicaStreamError):
            stream_broke(state, opened.replica.name, exc)
        else:
            log.warning("stream %s failed on %s: %s", rid, opened.replica.name, exc.message)
        await charge(progress.delivered)
        yield emit.error(exc.kind, exc.message)
    finally:
        # Reached on every exit: normal end, error, or the client hanging up (then
        # this runs under cancellation, hence the shield). A client that went away
        # pays for the tokens it was sent. NOTE: each step runs even if the one before
        # raised: the replica is told to stop first, and the key is never left held.
        with anyio.CancelScope(shield=True):
            try:
                await opened.stack.aclose()
            finally:
                try:
                    if not progress.billed:
                        await charge(progress.delivered)
                finally:
                    if job.claim is not None:
                        if progress.charged and recorded is not None:
                            await job.claim.complete(200, job.headers, b"".join(recorded), "sse")
                        else:
                            await job.claim.release()
