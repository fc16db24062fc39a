"""The gateway's side of the event plane: subscribe, resync, and keep serving without it.

While NATS is connected, heartbeats and kv batches feed the directory. While it is
not (or heartbeats go stale), the replicas' /v1/stats are polled instead, so routing
keeps load-only information and requests keep flowing. On reconnect every replica
is resynced from a snapshot.

Each replica's /readyz is polled too: one that fails it (or does not answer) leaves
routing until it passes again, even while its heartbeats keep coming.
A message whose subject names another replica than its payload is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.utils import suppress_http_instrumentation
from opentelemetry.trace import Link, SpanKind

from cachepoint.events import schema
from cachepoint.events.connect import connect_forever
from cachepoint.events.subjects import HEARTBEAT_ALL, KV_ALL, snapshot_subject, subject_replica
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.gateway.fleet.trust import UrlPolicy
from cachepoint.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def event_plane(settings: GatewaySettings, http: httpx.AsyncClient) -> GatewayBus:
    """The directory and the bus that feeds it, as the settings describe them."""
    directory = ReplicaDirectory(
        heartbeat_interval_s=settings.heartbeat_interval_s,
        urls=UrlPolicy(settings.url_check, dict(settings.replicas)),
        max_epoch_skew_s=settings.max_epoch_skew_s,
        block_size=settings.block_size,
    )
    password = settings.nats_password
    return GatewayBus(
        directory,
        settings.nats_url,
        http,
        seed_urls=[*settings.replica_urls, *settings.replicas.values()],
        nats_user=settings.nats_user,
        nats_password=password.get_secret_value() if password else None,
        health_interval_s=settings.health_interval_s,
    )


class GatewayBus:
    def __init__(
        self,
        directory: ReplicaDirectory,
        nats_url: str | None,
        http: httpx.AsyncClient,
        *,
        seed_urls: Sequence[str] = (),
        snapshot_timeout_s: float = 2.0,
        nats_user: str | None = None,
        nats_password: str | None = None,
        health_interval_s: float = 0.0,
        startup_timeout_s: float = 5.0,
    ) -> None:
        self.directory = directory
        self.nats_url = nats_url
        self.http = http
        self.seed_urls = list(seed_urls)  # replicas to poll before/without heartbeats
        self.snapshot_timeout_s = snapshot_timeout_s
        self.nats_user = nats_user  # None: connect without credentials
        self.nats_password = nats_password
        self.health_interval_s = health_interval_s  # /readyz poll period; 0 = no polls
        self.startup_timeout_s = startup_timeout_s  # the first /v1/stats poll's timeout
        self.nc: Client | None = None
        self.connected = False  # NATS up right now
        self.stale_batches = 0  # undecodable or unknown-version messages dropped
        self._tasks: list[asyncio.Task[None]] = []
        self._resyncing: set[str] = set()
        self.tracer: trace.Tracer = trace.NoOpTracer()  # set by the app when tracing is on
        self.lag_s = 0.0  # publish-to-apply delay of the last batch (event lag)

    async def start(self) -> None:
        # NOTE: know the static replicas before the first request. A replica that is
        # down refuses at once; one that is up but busy (a loaded host, its first
        # request) gets longer than a routine poll's second, or the gateway would
        # open with nothing to route to and answer 503 until the next round.
        await self._poll_stats(timeout_s=self.startup_timeout_s)
        self.directory.sweep()
        self._tasks.append(asyncio.create_task(self._maintain(), name="directory-sweep"))
        if self.health_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._health(), name="replica-health"))
        if self.nats_url:
            self._tasks.append(asyncio.create_task(self._connect(), name="nats-connect"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    # ------------------------------------------------------------------ NATS

    async def _connect(self) -> None:
        assert self.nats_url is not None
        nc = await connect_forever(
            self.nats_url,
            "cachepoint-gateway",
            user=self.nats_user,
            password=self.nats_password,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
            error_cb=self._on_error,
        )
        await nc.subscribe(KV_ALL, cb=self._on_kv)
        await nc.subscribe(HEARTBEAT_ALL, cb=self._on_heartbeat)
        self.nc = nc
        self.connected = True
        self._resync_all()

    async def _on_disconnect(self) -> None:
        self.connected = False

    async def _on_reconnect(self) -> None:
        self.connected = True
        # Anything may have been missed while away: rebuild every index.
        self._resync_all()

    async def _on_error(self, exc: Exception) -> None:
        # NOTE: reconnect attempts land here too (debug); a permissions violation means
        # the gateway's credentials or the server's config are wrong.
        if "permissions violation" in str(exc).lower():
            log.warning("NATS refused: %s", exc)
        else:
            log.debug("NATS error: %s", exc)

    def _subject_mismatch(self, subject: str, name: str) -> bool:
        # NOTE: NATS permissions bind a replica's credentials to its own subjects, so
        # the subject is the authenticated name; a payload naming another is forged.
        owner = subject_replica(subject)
        if owner == name:
            return False
        self.directory.reject("subject_mismatch", owner, f"{subject} carried {name!r}")
        return True

    async def _on_kv(self, msg: Msg) -> None:
        try:
            batch = schema.decode(msg.data, schema.EventBatch)
        except schema.SchemaError as exc:
            self.stale_batches += 1
            log.warning("dropping kv message on %s: %s", msg.subject, exc)
            return
        if self._subject_mismatch(msg.subject, batch.replica):
            return
        # NOTE: a CONSUMER span in its own trace, linked to the replica's PRODUCER span:
        # one batch serves many requests, so it is not any one request's child.
        producer = trace.get_current_span(propagate.extract(msg.headers or {})).get_span_context()
        links = [Link(producer)] if producer.is_valid else []
        with self.tracer.start_as_current_span(
            f"{msg.subject} process", kind=SpanKind.CONSUMER, links=links
        ) as span:
            self.lag_s = max(0.0, time.time() - batch.ts)
            gap = self.directory.on_batch(batch)
            span.set_attributes(
                {
                    "messaging.system": "nats",
                    "messaging.operation.type": "process",
                    "messaging.destination.name": msg.subject,
                    "cachepoint.kv.seq": batch.seq,
                    "cachepoint.kv.events": len(batch.events),
                    "cachepoint.kv.lag_s": self.lag_s,
                    "cachepoint.kv.gap": gap,
                }
            )
        if gap:
            self._spawn_resync(batch.replica)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = schema.decode(msg.data, schema.Heartbeat)
        except schema.SchemaError as exc:
            log.warning("dropping heartbeat: %s", exc)
            return
        if self._subject_mismatch(msg.subject, hb.name):
            return
        if self.directory.on_heartbeat(hb):
            self.directory.begin_resync(hb.name)
            self._spawn_resync(hb.name)

    def _resync_all(self) -> None:
        for name in list(self.directory.replicas):
            self.directory.begin_resync(name)
            self._spawn_resync(name)

    def _spawn_resync(self, name: str) -> None:
        if name in self._resyncing:
            return
        self._resyncing.add(name)
        self._tasks.append(asyncio.create_task(self._resync(name), name=f"resync-{name}"))

    async def _resync(self, name: str) -> None:
        try:
            for _ in range(5):
                nc = self.nc
                if nc is None or not self.connected:
                    self.directory.resync_failed(name)
                    return
                try:
                    reply = await nc.request(
                        snapshot_subject(name), b"", timeout=self.snapshot_timeout_s
                    )
                    snap = schema.decode(reply.data, schema.Snapshot)
                except Exception as exc:
                    log.warning("snapshot of %s failed: %s", name, exc)
                    self.directory.resync_failed(name)
                    return
                if snap.replica != name:
                    self.directory.reject("subject_mismatch", name, f"snapshot of {snap.replica}")
                    self.directory.resync_failed(name)
                    return
                if not self.directory.on_snapshot(snap):
                    return
        finally:
            self._resyncing.discard(name)

    # ------------------------------------------------------- load fallback

    async def _maintain(self) -> None:
        """Age out silent replicas; poll /v1/stats when heartbeats are not coming."""
        while True:
            await asyncio.sleep(self.directory.interval / 2)
            try:
                self.directory.sweep()
                if not self.connected or not any(
                    st.last_heartbeat for st in self.directory.replicas.values()
                ):
                    await self._poll_stats()
                    self.directory.sweep()
            except Exception as exc:  # silent replicas must keep ageing out
                log.warning("maintenance round failed: %s", exc)

    async def _poll_stats(self, timeout_s: float = 1.0) -> None:
        urls = set(self.seed_urls)
        urls.update(st.url for st in self.directory.replicas.values() if st.url)

        async def one(url: str) -> None:
            try:
                # NOTE: a poll is housekeeping, not a request: a trace per poll would
                # bury the requests' traces (the replica skips /v1/stats likewise).
                with suppress_http_instrumentation():
                    r = await self.http.get(f"{url}/v1/stats", timeout=timeout_s)
                if r.status_code == 200:
                    stats = r.json()
                    self.directory.on_stats(str(stats["replica"]), url, stats)
                    return
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                pass  # down, or not a replica's stats (a list, a null epoch): not routable
            # NOTE: a known replica that fails its poll leaves routing now rather than
            # after the miss window; its next heartbeat or good poll brings it back.
            for st in list(self.directory.replicas.values()):
                if st.url == url:
                    self.directory.mark_down(st.name)

        await asyncio.gather(*(one(u) for u in urls))

    # -------------------------------------------------------------- health

    async def _health(self) -> None:
        """Poll every known replica's /readyz; a failure takes it out of routing."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception as exc:  # the loop must outlive any one bad round
                log.warning("health check round failed: %s", exc)

    async def check_health(self) -> None:
        targets = [(st.name, st.url) for st in self.directory.replicas.values() if st.url]
        # NOTE: a busy replica may answer slowly; only one that cannot answer within
        # a whole interval (at least 1 s) counts as failing.
        timeout = max(1.0, self.health_interval_s)

        async def one(name: str, url: str) -> None:
            try:
                with suppress_http_instrumentation():
                    r = await self.http.get(f"{url}/readyz", timeout=timeout)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__} on /readyz"
            else:
                if r.status_code == 200:
                    self.directory.mark_healthy(name)
                    return
                why = f"/readyz answered {r.status_code}"
            # NOTE: the URL may have changed (a new epoch) while the check was out.
            if self.directory.url_of(name) == url:
                self.directory.mark_unhealthy(name, why)

        await asyncio.gather(*(one(n, u) for n, u in targets))
