"""Draining and routing by model over a real nats-server.

Replicas behind real uvicorns, the gateway on SQLite: a drained replica leaves the
gateway's routing as soon as its draining heartbeat lands (long before the next
periodic one) while the stream it runs finishes; and with two models in the fleet,
each request, alias included, reaches only a replica serving its model.
"""

from __future__ import annotations

import threading
from typing import Any

import anthropic
import httpx
import pytest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

from .test_event_plane import wait_for

# NOTE: long on purpose: the gateway must learn of a drain from the heartbeat the drain
# publishes, within a second, not from the next periodic one five seconds later.
HB = 5.0


class Fleet:
    def __init__(self, serve, free_port, nats, tmp_path, fleet: dict[str, str], **gw: Any):
        self.apps: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        for name, model in fleet.items():
            port = free_port()
            engine = Engine(
                ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=4096)
            )
            app = create_replica_app(
                ReplicaSettings(
                    name=name,
                    port=port,
                    model_name=model,
                    nats_url=nats.url,
                    heartbeat_interval_s=HB,
                    advertise_url=f"http://127.0.0.1:{port}",
                ),
                engine,
            )
            self.urls[name] = serve(app, port)
            self.apps[name] = app
        db = f"sqlite:///{tmp_path}/gw.db"
        e = make_engine(db)
        upgrade(e)
        with make_sessionmaker(e)() as s:
            self.key = create_key(s, create_org(s, "acme"))[1]
            s.commit()
        e.dispose()
        settings = GatewaySettings(
            database_url=db, nats_url=nats.url, heartbeat_interval_s=HB, **gw
        )
        self.gw_app = create_app(settings)
        self.url = serve(self.gw_app)
        wait_for(
            lambda: {v.name for v in self.directory.views() if v.live} == set(fleet),
            "every replica to be live",
        )

    @property
    def directory(self):
        return self.gw_app.state.directory

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0)

    def ask(self, model: str, text: str = "hi") -> tuple[str, Any]:
        raw = self.client().messages.with_raw_response.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": text}]
        )
        return raw.headers["cachepoint-replica"], raw.parse()


def test_a_drained_replica_leaves_routing_at_once_and_its_stream_finishes(
    serve, free_port, nats_server, tmp_path
):
    fleet = Fleet(
        serve, free_port, nats_server, tmp_path, {"r0": "cachepoint-tiny", "r1": "cachepoint-tiny"}
    )
    answer: dict[str, Any] = {}
    with fleet.client().messages.stream(
        model="cachepoint-tiny",
        max_tokens=1500,
        extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": "a long answer please"}],
    ) as stream:
        busy = stream.response.headers["cachepoint-replica"]
        other = "r1" if busy == "r0" else "r0"
        texts = stream.text_stream
        next(texts)
        assert fleet.apps[busy].state.drainer.in_flight.count == 1

        def drain() -> None:
            r = httpx.post(f"{fleet.urls[busy]}/v1/drain", json={"timeout_s": 60}, timeout=90)
            answer["status"], answer["body"] = r.status_code, r.json()

        drainer = threading.Thread(target=drain)
        drainer.start()
        wait_for(lambda: fleet.directory.replicas[busy].draining, "the gateway to see it", 1.5)
        assert busy not in {v.name for v in fleet.directory.views()}
        for i in range(4):  # new requests go elsewhere at once, none fails
            replica, msg = fleet.ask("cachepoint-tiny", f"while {busy} drains {i}")
            assert replica == other and msg.usage.output_tokens >= 1
        assert drainer.is_alive()  # the drain waits for the stream ...
        rest = "".join(texts)
        final = stream.get_final_message()
    drainer.join(60)
    assert answer == {"status": 200, "body": {"drained": True, "in_flight": 0}}  # ... to end
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    assert isinstance(rest, str)


def test_two_models_each_request_reaches_only_its_models_replica(
    serve, free_port, nats_server, tmp_path
):
    fleet = Fleet(
        serve,
        free_port,
        nats_server,
        tmp_path,
        {"ra": "model-a", "rb": "model-b"},
        models=["model-a", "model-b", "model-c"],
        model_aliases={"claude-*": "model-b"},
    )
    # Make model-a's replica look idle and model-b's busy: load alone would send all to ra.
    real = fleet.directory.on_heartbeat

    def rb_busy(hb):
        changed = real(hb)
        fleet.directory.replicas["rb"].view.queued_prefill_tokens = 90_000
        return changed

    fleet.directory.on_heartbeat = rb_busy
    fleet.directory.replicas["rb"].view.queued_prefill_tokens = 90_000
    for i in range(3):
        assert fleet.ask("model-a", f"a {i}")[0] == "ra"
        replica, msg = fleet.ask("model-b", f"b {i}")
        assert replica == "rb" and msg.model == "model-b"
        replica, msg = fleet.ask("claude-sonnet-4-5", f"alias {i}")  # resolved, then routed
        assert replica == "rb" and msg.model == "model-b"
    # Configured, but no replica serves it: a clear 404, never another model's replica.
    with pytest.raises(anthropic.NotFoundError, match="model-c is not served by any replica"):
        fleet.ask("model-c")
