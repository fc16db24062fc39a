"""The replica's side of the event plane (contract §4): kv event batches, heartbeats and
snapshots over NATS.

Losing NATS never stops serving: batches published while it is unreachable are
dropped once the client's reconnect buffer is full, and `seq` keeps counting, so
the gateway sees the gap and resyncs from a snapshot when it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from cachepoint.events import schema
from cachepoint.events.connect import connect_forever
from cachepoint.events.subjects import heartbeat_subject, kv_subject, snapshot_subject
from cachepoint.kvcore import KVEvent
from cachepoint.replica.interface import ReplicaCore

log = logging.getLogger(__name__)


class NatsBus:
    """Publishes what the scheduler's pool does; answers snapshot requests."""

    def __init__(
        self,
        scheduler: ReplicaCore,
        nats_url: str,
        advertise_url: str,
        *,
        heartbeat_interval_s: float = 1.0,
        listening: asyncio.Event | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.nats_url = nats_url
        self.advertise_url = advertise_url
        self.interval = heartbeat_interval_s
        # Set once the HTTP server accepts connections (None: it already does, or there
        # is none, as under an in-process test client).
        self.listening = listening
        self.seq = 0  # last batch seq of this epoch (published or lost)
        self.drop_next = 0  # test hook: lose the next N batches on purpose
        self.published = 0  # batches handed to NATS
        self.lost = 0  # batches that never left (NATS down, or the test hook)
        self.nc: Client | None = None
        self._queue: asyncio.Queue[tuple[str, bytes, dict[str, str]]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.tracer: trace.Tracer = trace.NoOpTracer()  # set by the app when tracing is on

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._connect(), name="nats-connect"),
            asyncio.create_task(self._sender(), name="nats-sender"),
            asyncio.create_task(self._heartbeats(), name="nats-heartbeat"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.nc is not None and self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    async def _connect(self) -> None:
        # NOTE: with credentials the server lets this user publish only its own kv and
        # heartbeat subjects (cachepoint.events.auth), so it cannot speak for another.
        st = self.scheduler.settings
        password = st.nats_password.get_secret_value() if st.nats_password else None
        nc = await connect_forever(
            self.nats_url,
            f"replica-{self.scheduler.name}",
            user=st.nats_user,
            password=password,
            error_cb=self._on_error,
        )
        await nc.subscribe(snapshot_subject(self.scheduler.name), cb=self._on_snapshot)
        self.nc = nc

    async def _on_error(self, exc: Exception) -> None:
        # NOTE: reconnect attempts land here too (debug); a permissions violation means
        # this replica's credentials do not match its name, which an operator must see.
        if "permissions violation" in str(exc).lower():
            log.warning("NATS refused: %s", exc)
        else:
            log.debug("NATS error: %s", exc)

    # ---------------------------------------------------------------- events

    def publish(self, epoch: int, events: list[KVEvent]) -> None:
        """The scheduler's EventSink: called on the loop thread after each step."""
        self.seq += 1
        if self.drop_next > 0:
            self.drop_next -= 1
            self.lost += 1
            return
        batch = schema.EventBatch(
            v=schema.SCHEMA_VERSION,
            replica=self.scheduler.name,
            epoch=epoch,
            seq=self.seq,
            ts=time.time(),
            events=schema.to_wire(events),
        )
        subject = kv_subject(self.scheduler.name)
        headers: dict[str, str] = {}
        with self.tracer.start_as_current_span(
            f"{subject} publish", kind=SpanKind.PRODUCER
        ) as span:
            span.set_attributes(
                {
                    "messaging.system": "nats",
                    "messaging.operation.type": "send",
                    "messaging.destination.name": subject,
                    "cachepoint.kv.seq": self.seq,
                    "cachepoint.kv.events": len(events),
                }
            )
            propagate.inject(headers)
        # NOTE: one sender task keeps batches in seq order on the wire.
        self._queue.put_nowait((subject, schema.encode(batch), headers))

    async def _sender(self) -> None:
        while True:
            subject, payload, headers = await self._queue.get()
            nc = self.nc
            if nc is None or nc.is_closed:
                self.lost += 1
                continue
            try:
                await nc.publish(subject, payload, headers=headers or None)
                self.published += 1
            except Exception as exc:  # reconnect buffer full, connection closing, ...
                self.lost += 1
                log.debug("kv batch lost: %s", exc)

    async def _on_snapshot(self, msg: Msg) -> None:
        # Publish whatever the pool did since the last step first, so the snapshot's
        # seq covers exactly the index it carries.
        self.scheduler.flush_events()
        held = self.scheduler.snapshot()
        snap = schema.Snapshot(
            v=schema.SCHEMA_VERSION,
            replica=self.scheduler.name,
            epoch=self.scheduler.epoch,
            seq=self.seq,
            block_hashes=list(held.get("device", ())),
            host_hashes=list(held.get("host", ())),
            disk_hashes=list(held.get("disk", ())),
        )
        await msg.respond(schema.encode(snap))

    # ------------------------------------------------------------ heartbeats

    def heartbeat(self) -> schema.Heartbeat:
        s = self.scheduler
        st = s.cache_stats()
        b = st.blocks
        return schema.Heartbeat(
            v=schema.SCHEMA_VERSION,
            name=s.name,
            url=self.advertise_url,
            epoch=s.epoch,
            model=s.model,
            block_size=s.block_size,
            last_seq=self.seq,
            queued_prefill_tokens=s.queued_prefill_tokens,
            running=len(s.running),
            waiting=len(s.waiting),
            max_waiting=s.settings.max_waiting,
            blocks_total=b.total,
            blocks_active=b.active,
            blocks_cached_free=b.cached_free,
            blocks_retained=b.retained,
            hit_tokens=st.hit_tokens,
            query_tokens=st.query_tokens,
            # The router prices a lower-tier hit by these (copy time against recompute).
            kv_bytes_per_token=s.kv_bytes_per_token,
            prefill_tokens_per_s=s.rates.prefill_tokens_per_s,
            host_read_bytes_per_s=s.rates.host_bytes_per_s,
            disk_read_bytes_per_s=s.rates.disk_bytes_per_s,
            ts=time.time(),
            draining=s.draining,
        )

    @property
    def serving(self) -> bool:
        """Heartbeat only while requests can be served: not before the server listens
        (the gateway would route into refused connections), not with a dead loop (its
        requests would never be answered), nor while the engine restarts (the gateway
        would route into 503s)."""
        s = self.scheduler
        listening = self.listening is None or self.listening.is_set()
        return listening and s.alive and s.unavailable is None

    async def announce(self) -> None:
        """Publish a heartbeat now (a drain began: the gateway must not wait an interval)."""
        nc = self.nc
        if nc is None or not nc.is_connected or not self.serving:
            return
        await nc.publish(heartbeat_subject(self.scheduler.name), schema.encode(self.heartbeat()))
        await nc.flush(timeout=2)

    async def _heartbeats(self) -> None:
        if self.listening is not None:
            # NOTE: the first heartbeat puts this replica in routing; sent from the app's
            # startup, it beat uvicorn's bind, and a rolling update's first request there
            # was refused (the other member was draining: the client got a 529).
            await self.listening.wait()
        while True:
            nc = self.nc
            # NOTE: a replica whose scheduler loop died must drop out of routing: no
            # heartbeat from it, however healthy its NATS connection.
            if nc is not None and nc.is_connected and self.serving:
                with contextlib.suppress(Exception):
                    subject = heartbeat_subject(self.scheduler.name)
                    await nc.publish(subject, schema.encode(self.heartbeat()))
            await asyncio.sleep(self.interval)
