"""The event plane authenticates and authorizes, on a real
nats-server running the generated config, with real replicas and a real gateway.

Before the fix any client could connect without credentials, announce a fake
replica whose URL was its own server (in routing within 1.5 s), and lock a real
replica out of routing with one heartbeat of epoch 2**62.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import anthropic
import httpx
import nats
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import generate_latest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.events import schema
from cachepoint.events.auth import GATEWAY_USER, fleet_users, render_authorization
from cachepoint.events.subjects import heartbeat_subject, kv_subject
from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

HB = 0.2  # heartbeat and health-poll interval here


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def heartbeat(name: str, url: str, epoch: int) -> bytes:
    zero = dict.fromkeys(
        ("last_seq", "queued_prefill_tokens", "running", "waiting", "blocks_active"), 0
    )
    zero |= dict.fromkeys(("blocks_cached_free", "blocks_retained", "hit_tokens"), 0)
    return schema.encode(
        schema.Heartbeat(
            v=schema.SCHEMA_VERSION,
            name=name,
            url=url,
            epoch=epoch,
            model="cachepoint-tiny",
            block_size=16,
            max_waiting=256,
            blocks_total=64,
            query_tokens=0,
            ts=time.time(),
            **zero,
        )
    )


def scrape(gw: FastAPI) -> str:
    """The gateway's Prometheus text, read from its registry (whatever port serves it)."""
    return generate_latest(gw.state.gateway.metrics.registry).decode()


def kv_batch(name: str, epoch: int, seq: int = 1) -> bytes:
    stored = schema.Stored([bytes(16)], None)
    return schema.encode(
        schema.EventBatch(schema.SCHEMA_VERSION, name, epoch, seq, time.time(), [stored])
    )


def gateway_db(tmp_path) -> tuple[str, str]:
    db = f"sqlite:///{tmp_path}/gw.db"
    e = make_engine(db)
    upgrade(e)
    with make_sessionmaker(e)() as s:
        key = create_key(s, create_org(s, "acme"))[1]
        s.commit()
    e.dispose()
    return db, key


class SecureFleet:
    """Replicas r0, r1 and a gateway, each connected with its own NATS user; the
    gateway knows each replica's URL (the embedded stack's exact map)."""

    def __init__(self, serve, free_port, nats, tmp_path) -> None:
        self.nats = nats
        self.ports = {n: free_port() for n in ("r0", "r1")}
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.apps = {}
        for name, port in self.ports.items():
            engine = Engine(
                ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048)
            )
            settings = ReplicaSettings(
                name=name,
                port=port,
                nats_url=nats.url,
                heartbeat_interval_s=HB,
                advertise_url=self.urls[name],
                **nats.creds(name),
            )
            self.apps[name] = create_replica_app(settings, engine)
            serve(self.apps[name], port)
        db, self.key = gateway_db(tmp_path)
        self.gw = create_app(
            GatewaySettings(
                database_url=db,
                nats_url=nats.url,
                heartbeat_interval_s=HB,
                min_cacheable_tokens=32,
                replicas=self.urls,
                health_interval_s=HB,
                **nats.creds(GATEWAY_USER),
            )
        )
        self.url = serve(self.gw)
        # NOTE: live alone can come from the health poll before the gateway's NATS
        # subscriptions exist; a heartbeat heard over NATS proves they do, so a test's
        # forged message cannot be published into the void.
        wait_for(lambda: self.live() == {"r0", "r1"} and self.heard(), "both heartbeats heard")

    def heard(self) -> bool:
        return all(
            n in self.directory.replicas and self.directory.replicas[n].last_heartbeat > 0
            for n in ("r0", "r1")
        )

    @property
    def directory(self):
        return self.gw.state.directory

    def live(self) -> set[str]:
        return {v.name for v in self.directory.views() if v.live}

    def converged(self, name: str) -> bool:
        st = self.directory.replicas[name]
        pool = set(self.apps[name].state.scheduler.pool.cached)
        return len(st.view.index) == len(pool) and all(h in st.view.index for h in pool)

    def ask(self, system: str) -> str:
        client = anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0)
        raw = client.messages.with_raw_response.create(
            model="cachepoint-tiny",
            max_tokens=2,
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hi"}],
        )
        return raw.headers["cachepoint-replica"]


@pytest.fixture
def fleet(serve, free_port, secure_nats, tmp_path) -> SecureFleet:
    return SecureFleet(serve, free_port, secure_nats, tmp_path)


async def _as_client(url: str, act, settle, **creds: str) -> list[str]:
    """Connect (optionally as a user), run ``act(nc)``, and return the server's
    asynchronous errors (permission violations arrive that way). ``settle`` is the
    ``nats_settle`` fixture: the server has read everything once it returns."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, allow_reconnect=False, error_cb=on_error, **creds)
    try:
        await act(nc)
        await settle(nc)
        await asyncio.sleep(0.3)  # the -ERR lines came before the PONG; let callbacks run
    finally:
        await nc.close()
    return errors


# ----------------------------------------------------------------- the config


def test_generated_config_is_accepted_by_the_real_server(tmp_path, secure_nats):
    conf = tmp_path / "check.conf"
    conf.write_text(render_authorization(fleet_users("gw-pw", {"a": "pa", "b-1": "pb"})))
    out = subprocess.run(
        [secure_nats.binary, "-t", "-c", str(conf)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "no_auth_user" not in conf.read_text()


# ------------------------------------------------------------ authentication


def test_clients_without_the_right_password_cannot_connect(secure_nats, nats_settle):
    async def attempt(**creds: str) -> None:
        with pytest.raises(Exception, match=r"(?i)authorization violation"):
            await nats.connect(secure_nats.url, allow_reconnect=False, connect_timeout=2, **creds)

    asyncio.run(attempt())  # anonymous
    asyncio.run(attempt(user="r0", password="guess"))

    async def ok(nc) -> None:  # and the generated password does work
        await nc.publish(heartbeat_subject("r0"), b"")

    creds = _creds(secure_nats, "r0")
    assert asyncio.run(_as_client(secure_nats.url, ok, nats_settle, **creds)) == []


# ------------------------------------------------------------- authorization


def test_the_gateway_permissions_carry_the_real_flow(fleet: SecureFleet):
    for name in ("r0", "r1"):  # lose a batch: only a snapshot resync heals it
        fleet.apps[name].state.bus.drop_next = 1
    served = {fleet.ask(f"system prompt number {i} " * 8) for i in range(6)}
    assert served <= {"r0", "r1"}
    for name in ("r0", "r1"):
        wait_for(lambda n=name: fleet.converged(n), f"{name}'s index to match its pool")
    assert fleet.directory.resyncs >= 1
    assert sum(len(fleet.directory.replicas[n].view.index) for n in ("r0", "r1")) > 0
    assert fleet.directory.rejections == {}


def test_a_replica_cannot_speak_for_another(fleet: SecureFleet, nats_settle):
    """r0's credentials (a compromised replica) try to take r1's traffic."""
    before = fleet.directory.replicas["r1"]
    r1_epoch, r1_url = before.epoch, before.url
    rogue = "http://127.0.0.1:9"

    async def act(nc) -> None:
        now = time.time_ns()
        await nc.publish(heartbeat_subject("r1"), heartbeat("r1", rogue, now))
        await nc.publish(kv_subject("r1"), kv_batch("r1", now))
        await nc.subscribe(kv_subject("r1"))  # and no sniffing of r1's hashes
        # Its own subjects with another name, or a URL that is not its own:
        await nc.publish(heartbeat_subject("r0"), heartbeat("r1", rogue, now))
        await nc.publish(kv_subject("r0"), kv_batch("r1", now))
        await nc.publish(heartbeat_subject("r0"), heartbeat("r0", rogue, now))

    errors = asyncio.run(_as_client(fleet.nats.url, act, nats_settle, **_creds(fleet.nats, "r0")))
    text = " ".join(errors).lower()
    assert 'permissions violation for publish to "cachepoint.replica.heartbeat.r1"' in text
    assert 'permissions violation for publish to "cachepoint.kv.r1"' in text
    assert 'permissions violation for subscription to "cachepoint.kv.r1"' in text
    wait_for(lambda: fleet.directory.rejections.get("url", 0) >= 1, "the URL refusal")
    assert fleet.directory.rejections.get("subject_mismatch", 0) >= 2
    after = fleet.directory.replicas["r1"]
    assert (after.epoch, after.url) == (r1_epoch, r1_url)
    assert fleet.directory.replicas["r0"].url == fleet.urls["r0"]
    time.sleep(3 * HB)
    assert fleet.live() == {"r0", "r1"}


def test_a_future_epoch_is_refused_and_the_replica_stays_routable(fleet: SecureFleet, nats_settle):
    """Even with r0's own credentials, an epoch of 2**62 changes nothing."""
    epoch = fleet.directory.replicas["r0"].epoch

    async def act(nc) -> None:
        await nc.publish(heartbeat_subject("r0"), heartbeat("r0", fleet.urls["r0"], 2**62))
        await nc.publish(kv_subject("r0"), kv_batch("r0", 2**62))

    creds = _creds(fleet.nats, "r0")
    assert asyncio.run(_as_client(fleet.nats.url, act, nats_settle, **creds)) == []
    wait_for(lambda: fleet.directory.rejections.get("future_epoch", 0) >= 2, "both refusals")
    time.sleep(4 * HB)  # past the miss window: the real heartbeats still count
    assert fleet.directory.replicas["r0"].epoch == epoch
    assert fleet.live() == {"r0", "r1"}
    metrics = scrape(fleet.gw)
    assert 'cachepoint_event_rejections_total{reason="future_epoch"}' in metrics


# -------------------------------------------------------------------- health


def test_a_replica_failing_readyz_leaves_routing_while_it_heartbeats(
    serve, free_port, secure_nats, tmp_path
):
    """A replica that heartbeats but answers /readyz with 503 is out of routing within
    about two health polls, and back once /readyz passes again."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state = {"ready": True, "beats": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nc = await nats.connect(secure_nats.url, **_creds(secure_nats, "r0"))
        epoch = time.time_ns()

        async def beat() -> None:
            while True:
                await nc.publish(heartbeat_subject("r0"), heartbeat("r0", url, epoch))
                state["beats"] += 1
                await asyncio.sleep(HB)

        task = asyncio.create_task(beat())
        yield
        task.cancel()
        with contextlib.suppress(Exception):  # NATS may be gone first at teardown
            await nc.close()

    replica = FastAPI(lifespan=lifespan)

    @replica.get("/readyz")
    async def readyz() -> JSONResponse:
        return JSONResponse({}, 200 if state["ready"] else 503)

    serve(replica, port)
    db, _ = gateway_db(tmp_path)
    gw = create_app(
        GatewaySettings(
            database_url=db,
            nats_url=secure_nats.url,
            heartbeat_interval_s=HB,
            health_interval_s=HB,
            replicas={"r0": url},
            **secure_nats.creds(GATEWAY_USER),
        )
    )
    gw_url = serve(gw)
    directory = gw.state.directory

    def live() -> bool:
        st = directory.replicas.get("r0")
        return bool(st and st.view.live)

    wait_for(live, "r0 live")
    state["ready"] = False
    t0 = time.monotonic()
    wait_for(lambda: not live(), "r0 out of routing", timeout=5)
    assert time.monotonic() - t0 <= 2 * HB + 0.6  # about two polls (and a loaded CI box)
    beats = state["beats"]
    time.sleep(4 * HB)
    assert state["beats"] > beats and not live()  # heartbeats alone do not bring it back
    assert httpx.get(f"{gw_url}/readyz").json()["replicas_live"] == 0
    assert "cachepoint_health_downs_total 1.0" in scrape(gw)
    state["ready"] = True
    wait_for(live, "r0 back once /readyz passes", timeout=5)


def _creds(server, user: str) -> dict[str, str]:
    return {"user": user, "password": server.passwords[user]}
