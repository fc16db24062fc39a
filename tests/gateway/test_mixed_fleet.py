"""A mixed fleet: one torch replica and one vLLM replica behind the gateway,
both publishing on one real nats-server. The vLLM replica's events come from vLLM's
own KV event stream through the kvcore mirror, so the gateway's cache-aware routing
must send each tenant's later turns to whichever replica holds its prefix.

First turns go through a second gateway with round-robin routing (same ledger, same
fleet), so that the two tenants start on different replicas by construction; every
later turn goes through the cache-aware gateway.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from sqlalchemy import create_engine, text

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

from ..conftest import VLLM_BLOCK, VllmReplica
from ..events.test_event_plane import wait_for

pytestmark = pytest.mark.slow

MODEL = "cachepoint-tiny"
TURNS = 4


def _ledger(db: str) -> dict[str, tuple[int, int, int, int]]:
    engine = create_engine(db)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT request_id, input_tokens, cache_read_input_tokens, "
                "cache_write_5m_tokens, output_tokens FROM usage"
            )
        ).fetchall()
    engine.dispose()
    return {r[0]: tuple(r[1:]) for r in rows}


def test_each_tenants_turns_go_to_the_replica_holding_its_prefix(
    vllm_replica: VllmReplica, serve: Any, free_port: Any, tmp_path: Any
) -> None:
    port = free_port()
    engine = Engine(
        ModelConfig.tiny(),
        EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=4096, block_size=VLLM_BLOCK),
    )
    serve(
        create_replica_app(
            ReplicaSettings(
                name="torch-0",
                port=port,
                block_size=VLLM_BLOCK,
                nats_url=vllm_replica.nats_url,
                heartbeat_interval_s=0.5,
                advertise_url=f"http://127.0.0.1:{port}",
            ),
            engine,
        ),
        port,
    )
    db = f"sqlite:///{tmp_path}/gw.db"
    e = make_engine(db)
    upgrade(e)
    keys = {}
    with make_sessionmaker(e)() as s:
        for tenant in ("north", "south"):
            keys[tenant] = create_key(s, create_org(s, tenant))[1]
        s.commit()
    e.dispose()

    def gateway(policy: str) -> tuple[str, Any]:
        settings = GatewaySettings(
            database_url=db,
            nats_url=vllm_replica.nats_url,
            block_size=VLLM_BLOCK,
            min_cacheable_tokens=64,
            heartbeat_interval_s=1.0,
            routing_policy=policy,
        )
        app = create_app(settings)
        return serve(app), app

    rr_url, rr_app = gateway("round_robin")
    ca_url, ca_app = gateway("cache_aware")
    fleet = {"torch-0", vllm_replica.name}
    for app in (rr_app, ca_app):
        wait_for(
            lambda app=app: {v.name for v in app.state.directory.views() if v.live} == fleet,
            "both replicas live in the gateway",
        )

    def ask(url: str, tenant: str, history: list[dict]) -> tuple[str, Any, str]:
        client = anthropic.Anthropic(base_url=url, api_key=keys[tenant], max_retries=0)
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=f"You are the {tenant} office's assistant; answer briefly. " * 6,
            messages=history,
            cache_control={"type": "ephemeral"},
        )
        return raw.headers["cachepoint-replica"], raw.parse(), raw.headers["request-id"]

    histories: dict[str, list[dict]] = {t: [] for t in keys}
    home: dict[str, str] = {}
    calls: list[tuple[str, Any]] = []
    for tenant in keys:
        histories[tenant].append({"role": "user", "content": f"{tenant}: turn 0"})
        replica, msg, rid = ask(rr_url, tenant, histories[tenant])
        home[tenant] = replica
        calls.append((rid, msg.usage))
        histories[tenant].append({"role": "assistant", "content": f"answer 0 for {tenant}"})
    assert set(home.values()) == fleet, home  # round robin: one tenant on each engine

    for turn in range(1, TURNS):
        for tenant in keys:
            histories[tenant].append({"role": "user", "content": f"{tenant}: turn {turn}"})
            replica, msg, rid = ask(ca_url, tenant, histories[tenant])
            calls.append((rid, msg.usage))
            assert replica == home[tenant], (tenant, turn, replica, home)
            # The previous turn's automatic breakpoint is read back on either engine.
            assert msg.usage.cache_read_input_tokens > 0, (tenant, turn, msg.usage)
            histories[tenant].append({"role": "assistant", "content": f"answer {turn}"})

    # What each client was told is what the ledger holds, call by call.
    rows = _ledger(db)
    assert len(rows) == len(calls)
    for rid, u in calls:
        cc = u.cache_creation
        told = (
            u.input_tokens,
            u.cache_read_input_tokens,
            cc.ephemeral_5m_input_tokens,
            u.output_tokens,
        )
        assert rows[rid] == told, (rid, rows[rid], told)
