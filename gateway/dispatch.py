"""Choosing a replica and talking to it: one generation, streamed or collected.

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

from .errors import ApiError
from .pipeline import ReportLimits, UsageReportError, buckets_of, check_output
from .state import GatewayState
from .upstream import (
    ReplicaClient,
    ReplicaRefusedError,
    ReplicaStreamError,
    ReplicaUnreachableError,
    Routed,
    RouteRequest,
)

log = logging.getLogger(__name__)

# NOTE: how often a request waiting on its replica (queue, prefill, a collected
# generation) checks that its client is still there; the replica's own disconnect poll
# is 0.2 s, and a check is one non-blocking receive.
DISCONNECT_POLL_S = 0.1
STOPS = ("end_turn", "max_tokens", "stop_sequence")  # the stop reasons a replica may give
# NOTE: a rolling update drains one replica at a time (maxUnavailable), so two more
# tries reach a serving one; a bound keeps a fleet-wide outage from looping.
MAX_REROUTES = 2


def pick(state: GatewayState, route: RouteRequest) -> Routed:
    with state.tracer.start_as_current_span("route") as span:
        try:
            routed = state.router.pick(route)
        except ApiError:
            state.metrics.route_decisions.labels("-", "no_replica").inc()
            raise
        policy = routed.decision.policy if routed.decision else "static"
        state.metrics.route_decisions.labels(policy, "routed").inc()
        span.set_attribute("cachepoint.route.replica", routed.replica.name)
        if routed.decision is not None:
            span.set_attributes(routed.decision.span_attributes())
        age = state.router.freshness_s(routed.replica.name)
        if age is not None:
            span.set_attribute("cachepoint.route.index_age_s", age)
        return routed


def reject_report(state: GatewayState, replica: str, exc: UsageReportError) -> None:
    """A usage report that cannot be true: nothing is billed from it, and the replica
    is taken out of routing as if it had failed."""
    log.warning("replica %s sent an unusable usage report: %s", replica, exc.reason)
    state.router.report_failure(replica)


def stream_broke(state: GatewayState, replica: str, exc: ReplicaStreamError) -> None:
    """The replica's stream broke mid-way: most likely it died. One line, no traceback."""
    log.warning("%s", exc.message)
    state.router.report_failure(replica)


def error_of(event: dict[str, Any]) -> ApiError:
    """An ``error`` line from the replica as the error the client sees."""
    err = event.get("error")
    err = err if isinstance(err, dict) else {}
    kind = str(err.get("type", "api_error"))
    status = 529 if kind == "overloaded_error" else 500
    return ApiError(status, kind, str(err.get("message", "replica failed")))


@dataclass(slots=True)
class Opened:
    """An upstream event stream whose prefill is done and whose report checked out."""

    replica: ReplicaClient  # who generates
    events: AsyncIterator[dict[str, Any]]  # the token, done and error lines
    cache: dict[str, Any]  # the replica's cache report, checked against the prompt
    stack: AsyncExitStack  # closing it closes the connection: the replica aborts


async def _open_once(
    state: GatewayState, replica: ReplicaClient, payload: dict[str, Any], limits: ReportLimits
) -> Opened:
    stack = AsyncExitStack()
    try:
        events = await stack.enter_async_context(replica.stream(payload))
        first = await anext(events)
        kind = first.get("type")
        if kind == "error":
            raise error_of(first)
        if kind != "prefill_done":
            raise UsageReportError(f"first event {str(kind)[:40]!r}, not prefill_done")
        cache = first.get("cache")
        if not isinstance(cache, dict):
            raise UsageReportError("prefill_done without a cache report")
        buckets_of(cache, 0, limits)
        return Opened(replica, events, cache, stack)
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
    route: RouteRequest,
    routed: Routed,
    payload: dict[str, Any],
    limits: ReportLimits,
) -> Opened:
    """Open the replica's stream and wait for its prefill. A replica that is down (it is
    reported) or refuses with 503 (draining, shutting down: nothing ran there) is
    skipped, and the request routed again, elsewhere, up to ``MAX_REROUTES`` times; the
    last refusal is what the client sees when no other replica can take it."""
    tried: list[str] = []
    while True:
        try:
            return await _open_once(state, routed.replica, payload, limits)
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
    route: RouteRequest,
    routed: Routed,
    payload: dict[str, Any],
    limits: ReportLimits,
    client_gone: Callable[[], Awaitable[bool]],
) -> Opened | None:
    """``open_stream``, or None if the client hangs up while the request is queued or
    prefilling: the connection is closed, and the replica drops the request before its
    prefill commits (no ``prefill_done``, so nothing to bill)."""
    task = asyncio.ensure_future(open_stream(state, route, routed, payload, limits))
    if await _watch(task, client_gone):
        return task.result()
    return None


@dataclass(slots=True)
class Generation:
    """A collected generation: finished, or stopped because the client went away."""

    replica: str  # who generated (who was asked, until a prefill is done)
    cache: dict[str, Any] | None  # the checked cache report; None: stopped before prefill_done
    output_tokens: int  # tokens generated (token events received)
    result: dict[str, Any] | None  # the replica's final response; None when stopped


async def _collect(opened: Opened, gen: Generation, limits: ReportLimits) -> None:
    async for ev in opened.events:
        kind = ev.get("type")
        if kind == "token":
            gen.output_tokens = check_output(gen.output_tokens + 1, limits)
        elif kind == "done":
            result = ev.get("response")
            if not isinstance(result, dict) or result.get("output_tokens") != gen.output_tokens:
                got = result.get("output_tokens") if isinstance(result, dict) else None
                raise UsageReportError(
                    f"final output_tokens {got!r} after {gen.output_tokens} token events"
                )
            if not isinstance(result.get("text"), str) or result.get("stop_reason") not in STOPS:
                raise ReplicaStreamError(opened.replica.name, "malformed final response")
            gen.result = result
            return
        elif kind == "error":
            raise error_of(ev)
    raise ReplicaStreamError(opened.replica.name, "stream ended before done")


async def _run(
    state: GatewayState,
    route: RouteRequest,
    routed: Routed,
    payload: dict[str, Any],
    limits: ReportLimits,
    gen: Generation,
) -> None:
    """Open, wait for the prefill and collect: one task, so that a hang-up at any point
    closes the connection (cancelled, the stack closes it) and the replica stops."""
    opened = await open_stream(state, route, routed, payload, limits)
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
    route: RouteRequest,
    routed: Routed,
    payload: dict[str, Any],
    limits: ReportLimits,
    client_gone: Callable[[], Awaitable[bool]] | None,
) -> Generation:
    """Run one generation to its end, or until ``client_gone`` says the client hung up
    (then ``result`` is None and ``output_tokens`` is what was generated before the
    replica was told to stop; ``cache`` is None too if it was still queued or
    prefilling). ``client_gone`` None: run to the end regardless."""
    gen = Generation(routed.replica.name, None, 0, None)
    task = asyncio.ensure_future(_run(state, route, routed, payload, limits, gen))
    await _watch(task, client_gone)
    return gen
