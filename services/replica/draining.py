"""Draining: a replica that is going away stops taking requests, says so, and lets the
requests it runs finish before it exits.

Two ways in, one behaviour: ``POST /v1/drain`` (the pod's preStop hook runs
``python -m cachepoint.replica.prestop``), and SIGTERM (``cachepoint.runtime.serve`` calls the
app's ``state.drain`` before it shuts the server down). Either one:

- marks the scheduler draining: a new ``/v1/generate`` gets 503 ``overloaded_error``,
  which the gateway retries on another replica;
- publishes a heartbeat with ``draining: true`` at once, so the gateway stops routing
  here without waiting for the next interval; every later heartbeat says so too;
- waits until no ``/v1/generate`` call is in flight (streams included), or the
  timeout, whichever comes first.

Readiness fails while draining (routes/health.py); liveness does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from cachepoint.replica.interface import ReplicaCore
from cachepoint.replica.requestlog import LOGGER

log = logging.getLogger(f"{LOGGER}.drain")

GENERATE_PATH = "/v1/generate"


class InFlight:
    """How many generate calls are between their first byte in and their last byte out."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight; False if ``timeout_s`` passed first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self.count == 0


class CountInFlight:
    """ASGI middleware: counts the calls to ``/v1/generate`` in ``counter``.

    NOTE: at the ASGI level, not in the route: a streamed response's call returns only
    after its last line was sent, so a drain waits for the stream itself, not just for
    the sequence behind it to finish.
    """

    def __init__(self, app: ASGIApp, counter: InFlight) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        self.counter.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.leave()


@dataclass(frozen=True, slots=True)
class DrainResult:
    drained: bool  # nothing was in flight when the drain returned
    in_flight: int  # generate calls still running then (0 when drained)


Announce = Callable[[], Awaitable[None]]


class Drainer:
    """Drains one replica: its scheduler, its in-flight calls, its heartbeat."""

    def __init__(
        self, scheduler: ReplicaCore, in_flight: InFlight, announce: Announce | None = None
    ) -> None:
        self.scheduler = scheduler
        self.in_flight = in_flight
        self.announce = announce  # publishes a heartbeat now (None: no event plane)

    async def drain(self, timeout_s: float, *, why: str) -> DrainResult:
        """Stop taking requests, announce it, wait up to ``timeout_s`` for the in-flight
        ones. Idempotent: a second call (SIGTERM after the preStop) waits again."""
        s = self.scheduler
        first = not s.draining
        s.draining = True
        if first:
            log.info(
                "draining: no new requests; %d in flight",
                self.in_flight.count,
                extra={
                    "fields": {
                        "event": "replica_draining",
                        "replica": s.name,
                        "epoch": s.epoch,
                        "why": why,
                        "in_flight": self.in_flight.count,
                        "timeout_s": timeout_s,
                    }
                },
            )
        if self.announce is not None:
            try:
                await self.announce()
            except Exception as exc:  # NATS down: the periodic heartbeats say it later
                log.warning("could not announce draining now: %s", exc)
        drained = await self.in_flight.wait_idle(timeout_s)
        result = DrainResult(drained, self.in_flight.count)
        log.info(
            "drain %s with %d in flight",
            "done" if drained else "timed out",
            result.in_flight,
            extra={
                "fields": {
                    "event": "replica_drained",
                    "replica": s.name,
                    "epoch": s.epoch,
                    "drained": drained,
                    "in_flight": result.in_flight,
                }
            },
        )
        return result
