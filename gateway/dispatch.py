"""Talking to the chosen replica on the request path: one generation, streamed or
collected, its events checked against what was sent, and rerouted when a replica
refuses it before anything ran.

A non-streaming request also runs as the replica's event stream, so that a client who
hangs up can stop it: closing the stream makes the replica abort the generation, and
the tokens counted so far are what was generated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any

from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.fleet.routing import Routed, RouteRequest, decide
from cachepoint.gateway.fleet.upstream import (
    ReplicaClient,
    ReplicaRefusedError,
    ReplicaStreamError,
    ReplicaUnreachableError,
    UsageReportError,
)
from cachepoint.gateway.pipeline import ReportLimits, buckets_of, check_output
from cachepoint.gateway.state import GatewayState
from cachepoint.protocol import (
    CacheReport,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateRequest,
    GenerateResponse,
    PrefillDoneEvent,
    TokenEvent,
    event_name,
)

log = logging.getLogger(__name__)

# NOTE: how often a request waiting on its replica (queue, prefill, a collected
# generation) checks that its client is still there; the replica's own disconnect poll
# is 0.2 s, and a check is one non-blocking receive.
DISCONNECT_POLL_S = 0.1
# NOTE: a rolling update drains one replica at a time (maxUnavailable), so two more
# tries reach a serving one; a bound keeps a fleet-wide outage from looping.
MAX_REROUTES = 2


def pick(state: GatewayState, route: RouteRequest) -> Routed:
    """The app's router's choice for ``route``, traced and counted."""
    return decide(state.router, route, tracer=state.tracer, metrics=state.metrics)


def reject_report(state: GatewayState, replica: str, exc: UsageReportError) -> None:
    """A usage report that cannot be true: nothing is billed from it, and the replica
    is taken out of routing as if it had failed."""
    log.warning("replica %s sent an unusable usage report: %s", replica, exc.reason)
    state.router.report_failure(replica)


def stream_broke(state: GatewayState, replica: str, exc: ReplicaStreamError) -> None:
    """The replica's stream broke mid-way: most likely it died. One line, no traceback."""
    log.warning("%s", exc.message)
    state.router.report_failure(replica)


def error_of(event: ErrorEvent) -> ApiError:
    """An error event from the replica as the error the client sees."""
    kind = event.error.type
    status = 529 if kind == "overloaded_error" else 500
    return ApiError(status, kind, event.error.message)


def check_final(done: DoneEvent, output_tokens: int) -> GenerateResponse:
    """The final response, once its output count agrees with the token events seen."""
    result = done.response
    if result.output_tokens != output_tokens:
        raise UsageReportError(
            f"final output_tokens {result.output_tokens!r} after {output_tokens} token events"
        )
    return result


@dataclass(slots=True)
class Opened:
    """An upstream event stream whose prefill is done and whose report checked out."""

    replica: ReplicaClient  # who generates
    events: AsyncIterator[Event]  # the token, done and error events
    cache: CacheReport  # the replica's cache report, checked against the prompt
    stack: AsyncExitStack  # closing it closes the connection: the replica aborts


async def _open_once(
    state: GatewayState, replica: ReplicaClient, request: GenerateRequest, limits: ReportLimits
) -> Opened:
    stack = AsyncExitStack()
    try:
        events = await stack.enter_async_context(replica.stream(request))
        first = await anext(events)
        if isinstance(first, ErrorEvent):
            raise error_of(first)
        if not isinstance(first, PrefillDoneEvent):
            expected = event_name(PrefillDoneEvent)
            raise UsageReportError(f"first event {first.type[:40]!r}, not {expected}")
        buckets_of(first.cache, 0, limits)
        return Opened(replica=replica, events=events, cache=first.cache, stack=stack)
    except BaseException as exc:
        await stack.aclose()
        if isinstance(exc, UsageReportError):
            reject_report(state, replica.name, exc)
        elif isinstance(exc, ReplicaStreamError):
            stream_broke(state, replica.name, exc)
        if isinstance(exc, StopAsyncIteration):
            raise ReplicaStreamError(replica.name, "no events") from None
        raise


async def open_stream(
    state: GatewayState,
    *,
    route: RouteRequest,
    routed: Routed,
    request: GenerateRequest,
    limits: ReportLimits,
) -> Opened:
    """Open the replica's stream and wait for its prefill. A replica that is down (it is
    reported) or refuses with 503 (draining, shutting down: nothing ran there) is
    skipped, and the request routed again, elsewhere, up to ``MAX_REROUTES`` times; the
    last refusal is what the client sees when no other replica can take it."""
    tried: list[str] = []
    while True:
        try:
            return await _open_once(state, routed.replica, request, limits)
        except (ReplicaUnreachableError, ReplicaRefusedError) as exc:
            name = routed.replica.name
            if isinstance(exc, ReplicaUnreachableError):
                # It died before its heartbeat went stale.
                state.router.report_failure(name)
            else:
                log.info("replica %s refused a request (%s); routing it elsewhere", name, exc)
            tried.append(name)
            if len(tried) > MAX_REROUTES:
                raise
            try:
                routed = pick(state, replace(route, avoid=frozenset(tried)))
            except ApiError:
                raise exc from None


async def _watch(
    task: asyncio.Task[Any], client_gone: Callable[[], Awaitable[bool]] | None
) -> bool:
    """Await ``task`` (its error is raised); False when ``client_gone`` said the client
    hung up first, and the task was cancelled for it."""
    stopped = False
    try:
        if client_gone is not None:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await client_gone():
                    stopped = task.cancel()
                    break
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not stopped or (current is not None and current.cancelling()):
                raise
        return not stopped
    finally:
        if not task.done():  # we were cancelled ourselves
            task.cancel()
            await asyncio.wait({task})


async def open_watched(
    state: GatewayState,
    *,
    route: RouteRequest,
    routed: Routed,
    request: GenerateRequest,
    limits: ReportLimits,
    client_gone: Callable[[], Awaitable[bool]],
) -> Opened | None:
    """``open_stream``, or None if the client hangs up while the request is queued or
    prefilling: the connection is closed, and the replica drops the request before its
    prefill commits (no ``prefill_done``, so nothing to bill)."""
    opening = open_stream(state, route=route, routed=routed, request=request, limits=limits)
    task = asyncio.ensure_future(opening)
    if await _watch(task, client_gone):
        return task.result()
    return None


@dataclass(slots=True)
class Generation:
    """A collected generation: finished, or stopped because the client went away."""

    replica: str  # who generated (who was asked, until a prefill is done)
    cache: CacheReport | None  # the checked cache report; None: stopped before prefill_done
    output_tokens: int  # tokens generated (token events received)
    result: GenerateResponse | None  # the replica's final response; None when stopped


async def _collect(opened: Opened, gen: Generation, limits: ReportLimits) -> None:
    async for ev in opened.events:
        if isinstance(ev, TokenEvent):
            gen.output_tokens = check_output(gen.output_tokens + 1, limits)
        elif isinstance(ev, DoneEvent):
            gen.result = check_final(ev, gen.output_tokens)
            return
        elif isinstance(ev, ErrorEvent):
            raise error_of(ev)
    raise ReplicaStreamError(opened.replica.name, "stream ended before done")


async def _run(
    state: GatewayState,
    *,
    route: RouteRequest,
    routed: Routed,
    request: GenerateRequest,
    limits: ReportLimits,
    gen: Generation,
) -> None:
    """Open, wait for the prefill and collect: one task, so that a hang-up at any point
    closes the connection (cancelled, the stack closes it) and the replica stops."""
    opened = await open_stream(state, route=route, routed=routed, request=request, limits=limits)
    gen.replica, gen.cache = opened.replica.name, opened.cache
    async with opened.stack:
        try:
            await _collect(opened, gen, limits)
        except UsageReportError as exc:
            reject_report(state, gen.replica, exc)
            raise
        except ReplicaStreamError as exc:
            stream_broke(state, gen.replica, exc)
            raise


async def generate(
    state: GatewayState,
    *,
    route: RouteRequest,
    routed: Routed,
    request: GenerateRequest,
    limits: ReportLimits,
    client_gone: Callable[[], Awaitable[bool]] | None,
) -> Generation:
    """Run one generation to its end, or until ``client_gone`` says the client hung up
    (then ``result`` is None and ``output_tokens`` is what was generated before the
    replica was told to stop; ``cache`` is None too if it was still queued or
    prefilling). ``client_gone`` None: run to the end regardless."""
    gen = Generation(replica=routed.replica.name, cache=None, output_tokens=0, result=None)
    run = _run(state, route=route, routed=routed, request=request, limits=limits, gen=gen)
    task = asyncio.ensure_future(run)
    await _watch(task, client_gone)
    return gen
