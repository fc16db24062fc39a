"""Replicas, a gateway and a real nats-server: the event plane end to end."""

from __future__ import annotations

import time
from collections.abc import Callable

import anthropic
import pytest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

HB = 0.2  # heartbeat interval for these tests: timeouts after 0.6 s


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Fleet:
    def __init__(self, serve, free_port, nats, tmp_path, names=("r0", "r1")) -> None:
        self.serve, self.nats = serve, nats
        self.replicas: dict[str, tuple[str, object]] = {}
        self.ports = {n: free_port() for n in names}
        for name in names:
            self.start_replica(name)
        db = f"sqlite:///{tmp_path}/gw.db"
        e = make_engine(db)
        upgrade(e)
        with make_sessionmaker(e)() as s:
            self.keys = {o: create_key(s, create_org(s, o))[1] for o in ("acme", "zeta")}
            s.commit()
        e.dispose()
        self.gw_app = create_app(
            GatewaySettings(
                database_url=db,
                nats_url=nats.url,
                heartbeat_interval_s=HB,
                min_cacheable_tokens=32,
            )
        )
        self.url = serve(self.gw_app)
        wait_for(
            lambda: len([v for v in self.directory.views() if v.live]) == len(names),
            "every replica to be live",
        )

    def start_replica(self, name: str) -> None:
        port = self.ports[name]
        engine = Engine(
            ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048)
        )
        app = create_replica_app(
            ReplicaSettings(
                name=name,
                port=port,
                nats_url=self.nats.url,
                heartbeat_interval_s=HB,
                advertise_url=f"http://127.0.0.1:{port}",
            ),
            engine,
        )
        self.replicas[name] = (self.serve(app, port), app)

    def stop_replica(self, name: str) -> None:
        url, _ = self.replicas.pop(name)
        self.serve.stop(url)

    @property
    def directory(self):
        return self.gw_app.state.directory

    def scheduler(self, name: str):
        return self.replicas[name][1].state.scheduler

    def converged(self, name: str) -> bool:
        st = self.directory.replicas.get(name)
        if st is None:
            return False
        pool = set(self.scheduler(name).pool.cached)
        return len(st.view.index) == len(pool) and all(h in st.view.index for h in pool)

    def client(self, org: str = "acme") -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=self.keys[org], max_retries=0)

    def ask(self, org: str, system: str, user: str = "hi") -> tuple[str, object]:
        raw = self.client(org).messages.with_raw_response.create(
            model="cachepoint-tiny",
            max_tokens=2,
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": user}],
        )
        return raw.headers["cachepoint-replica"], raw.parse()


@pytest.fixture
def fleet(serve, free_port, nats_server, tmp_path) -> Fleet:
    return Fleet(serve, free_port, nats_server, tmp_path)


def test_event_plane_indexes_mirror_the_pools(fleet: Fleet):
    for i in range(4):
        fleet.ask("acme", f"system prompt number {i} " * 8)
    for name in ("r0", "r1"):
        wait_for(lambda n=name: fleet.converged(n), f"{name}'s index to match its pool")
    assert sum(len(fleet.directory.replicas[n].view.index) for n in ("r0", "r1")) > 0


def test_event_plane_dropped_batch_is_healed_by_resync(fleet: Fleet):
    for name in ("r0", "r1"):
        fleet.replicas[name][1].state.bus.drop_next = 1  # lose the next batch on purpose
    for i in range(4):
        fleet.ask("acme", f"another long system prompt {i} " * 8)
    for name in ("r0", "r1"):
        wait_for(lambda n=name: fleet.converged(n), f"{name} to converge after the gap")
    assert fleet.directory.resyncs >= 1


def test_event_plane_restart_clears_and_dead_replica_is_skipped(fleet: Fleet):
    for i in range(4):
        fleet.ask("acme", f"warm prompt {i} " * 10)
    old_epoch = fleet.scheduler("r1").epoch
    fleet.stop_replica("r1")
    wait_for(lambda: not fleet.directory.replicas["r1"].view.live, "r1 to leave routing")
    for i in range(4):  # nothing goes to the dead replica
        replica, _ = fleet.ask("acme", f"while r1 is down {i} " * 6)
        assert replica == "r0"
    fleet.start_replica("r1")
    wait_for(lambda: fleet.directory.replicas["r1"].epoch > old_epoch, "r1's new epoch")
    wait_for(lambda: fleet.converged("r1"), "r1's fresh index")
    assert len(fleet.directory.replicas["r1"].view.index) == len(fleet.scheduler("r1").pool.cached)


def test_event_plane_survives_nats_outage(fleet: Fleet):
    fleet.nats.stop()
    wait_for(lambda: not fleet.gw_app.state.bus.connected, "the gateway to notice")
    for i in range(6):  # load-only routing from /v1/stats keeps requests flowing
        _, msg = fleet.ask("acme", f"during the outage {i} " * 6)
        assert msg.usage.output_tokens >= 1
    fleet.nats.start()
    wait_for(lambda: fleet.gw_app.state.bus.connected, "the gateway to reconnect", 20)
    fleet.ask("acme", "after the outage " * 6)
    for name in ("r0", "r1"):
        wait_for(lambda n=name: fleet.converged(n), f"{name} to converge after NATS returns", 20)


def test_event_plane_routes_returning_session_to_its_prefix(fleet: Fleet):
    system = "You are a meticulous assistant for a travel agency. " * 12
    first, _ = fleet.ask("acme", system, "turn one")
    wait_for(lambda: fleet.converged(first), "the index to learn the prefix")
    for turn in range(4):
        replica, msg = fleet.ask("acme", system, f"turn {turn + 2}")
        assert replica == first
        assert msg.usage.cache_read_input_tokens > 0
    # A cold tenant goes to the less loaded replica.
    other = "r1" if first == "r0" else "r0"
    # Make `first` look busy, and keep it so: its heartbeats would report the truth.
    real = fleet.directory.on_heartbeat

    def busy(hb):
        changed = real(hb)
        fleet.directory.replicas[first].view.queued_prefill_tokens = 50_000
        return changed

    fleet.directory.on_heartbeat = busy
    fleet.directory.replicas[first].view.queued_prefill_tokens = 50_000
    replica, _ = fleet.ask("zeta", "A completely different tenant's prompt. " * 10)
    assert replica == other
