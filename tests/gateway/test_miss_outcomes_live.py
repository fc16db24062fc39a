"""The reasons only the server knows, each produced for real: a turn whose prompt only
appended to the turn before, through the official SDK against a live gateway and real
torch replicas, reads less than that turn cached, and the ledger says why.

- ``entry_expired``: both clocks (the replica's TTL clock, the gateway's wall clock)
  moved past the entry's 5 minutes;
- ``not_retained``: the org's retention quota was full, so the turn before kept nothing;
- ``routed_elsewhere``: the replica holding the entry drained, the turn went to the
  other one;
- ``replica_restarted``: the replica restarted between the two turns;
- ``scope_changed`` and ``betas_changed``: the same prompt under the other scope, or
  with a cache-key beta gone (the cache missed: the key changed, not the prompt).

(``entry_evicted`` cannot happen on the torch engine, which never drops a retained
block before its TTL; it is produced on vLLM without the retention connector, in
tests/gateway/test_miss_outcomes_vllm.py.)
"""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest
from sqlalchemy import select

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.contract.breakpoints import SCOPE_BETA
from cachepoint.gateway.db.models import UsageRecord
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import get_org, set_policy
from cachepoint.kvcore import ManualClock
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

from ..events.test_event_plane import wait_for

MODEL = "cachepoint-tiny"
SYSTEM = "You are the support agent for a company that sells kettles. " * 4
U1, A1, U2 = "Where is my order #1234?", "It ships tomorrow.", "Can I change the address?"
BETA = "context-1m-2025-08-07"  # in the default cache_key_betas: it changes the cache key


def tiny(kv_bytes: int = 16 * 2**20) -> Engine:
    return Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=kv_bytes, max_model_len=2048))


class Stack:
    """A gateway on SQLite in front of named torch replicas, with movable clocks: the
    replicas' TTL clock and the gateway's wall clock (an offset)."""

    def __init__(
        self,
        serve: Any,
        seeded_db: tuple[str, dict[str, str]],
        names: list[str],
        engine: Any = tiny,
        **replica_kw: Any,
    ):
        self.serve = serve
        self.db, self.keys = seeded_db
        self.ttl_clock = ManualClock(1_000.0)
        self.offset = 0.0
        self.engine, self.replica_kw = engine, replica_kw
        self.urls = {name: self.replica(name) for name in names}
        settings = GatewaySettings(
            database_url=self.db,
            replica_urls=list(self.urls.values()),
            min_cacheable_tokens=64,
            heartbeat_interval_s=0.5,
        )
        self.app = create_app(settings)
        self.url = serve(self.app)
        self.app.state.gateway.clock = lambda: time.time() + self.offset
        wait_for(lambda: len(self.live()) == len(names), "every replica live in the gateway")

    def replica(self, name: str, port: int | None = None) -> str:
        settings = ReplicaSettings(name=name, **self.replica_kw)
        app = create_replica_app(settings, self.engine(), clock=self.ttl_clock)
        return self.serve(app, port)

    def live(self) -> set[str]:
        return {v.name for v in self.app.state.directory.views() if v.live}

    def advance(self, seconds: float) -> None:
        self.ttl_clock.advance(seconds)
        self.offset += seconds

    def ask(self, messages: list[dict], *, who: str = "a", system: Any = SYSTEM, **kw: Any):
        c = anthropic.Anthropic(base_url=self.url, api_key=self.keys[who], max_retries=0)
        raw = c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            system=system,
            messages=messages,
            extra_body={"temperature": 0.0},
            **kw,
        )
        return raw.headers["cachepoint-replica"], raw.parse()

    def ledger(self, request_id: str) -> tuple[str | None, int | None, str | None]:
        engine = make_engine(self.db)
        try:
            with engine.connect() as conn:
                row = conn.execute(
                    select(
                        UsageRecord.miss_reason, UsageRecord.miss_tokens, UsageRecord.miss_detail
                    ).where(UsageRecord.request_id == request_id)
                ).one()
        finally:
            engine.dispose()
        return row[0], row[1], row[2]


def cached(text: str) -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


OPT_IN = {"previous_message_id": None}  # a first turn that opts in: its fingerprint is kept
TURN1 = [{"role": "user", "content": [cached(U1)]}]
TURN2 = [
    {"role": "user", "content": [{"type": "text", "text": U1}]},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": [cached(U2)]},
]


def two_turns(stack: Stack, between: Any = None, **kw: Any) -> tuple[Any, Any, str, str]:
    """Turn 1, ``between()``, then turn 2 naming turn 1 (opted in): the two answers and
    the replicas that served them. Turn 2's prompt only appends to turn 1's."""
    r1, first = stack.ask(TURN1, diagnostics={"previous_message_id": None}, **kw)
    assert first.usage.cache_creation_input_tokens > 0
    if between is not None:
        between(r1)
    r2, second = stack.ask(TURN2, diagnostics={"previous_message_id": first.id}, **kw)
    # Anthropic's answer is about the prompt, which only appended: null.
    assert second.diagnostics is None
    return first, second, r1, r2


@pytest.fixture
def one(serve, seeded_db) -> Stack:
    return Stack(serve, seeded_db, ["r0"])


def test_an_entry_past_its_ttl_is_entry_expired(one):
    first, second, _, _ = two_turns(one, lambda _: one.advance(301))
    written = first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens == 0  # the 5m entry is gone
    assert one.ledger(second._request_id) == ("entry_expired", written, None)


def test_an_entry_within_its_ttl_is_read_and_nothing_is_reported(one):
    first, second, _, _ = two_turns(one, lambda _: one.advance(299))
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens
    assert one.ledger(second._request_id) == ("none", None, None)


def test_a_restarted_replica_is_replica_restarted(serve, seeded_db):
    stack = Stack(serve, seeded_db, ["r0"])
    before = stack.app.state.directory.replicas["r0"].epoch

    def restart(_: str) -> None:
        url = stack.urls["r0"]
        serve.stop(url)
        stack.replica("r0", int(url.rsplit(":", 1)[1]))
        wait_for(
            lambda: (
                stack.app.state.directory.replicas["r0"].epoch > before and "r0" in stack.live()
            ),
            "the gateway sees the new process",
        )

    first, second, _, _ = two_turns(stack, restart)
    assert second.usage.cache_read_input_tokens == 0
    written = first.usage.cache_creation_input_tokens
    assert stack.ledger(second._request_id) == ("replica_restarted", written, None)


def test_a_turn_sent_to_another_replica_is_routed_elsewhere(serve, seeded_db):
    stack = Stack(serve, seeded_db, ["r0", "r1"])
    drained: list[str] = []

    def drain(home: str) -> None:
        # The replica holding the entry leaves routing (as in a rolling update).
        assert httpx.post(
            f"{stack.urls[home]}/v1/drain", json={"timeout_s": 5}, timeout=30
        ).is_success
        drained.append(home)
        wait_for(lambda: home not in stack.live() or _draining(stack, home), "drain seen")

    first, second, r1, r2 = two_turns(stack, drain)
    assert (r1, r2 != r1) == (drained[0], True)
    written = first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens == 0
    assert stack.ledger(second._request_id) == ("routed_elsewhere", written, f"entry on {r1}")


def _draining(stack: Stack, name: str) -> bool:
    return stack.app.state.directory.replicas[name].draining


@pytest.fixture
def small(serve, seeded_db) -> Stack:
    """One replica whose pool of 64 blocks retains at most 32, an org at most 16."""
    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4

    def engine() -> Engine:
        return Engine(cfg, EngineConfig(kv_cache_bytes=64 * per_block, max_model_len=512))

    return Stack(serve, seeded_db, ["r0"], engine, retained_share=0.5)


def test_a_turn_after_one_whose_retention_was_refused_is_not_retained(small):
    def system(i: int) -> list[dict]:
        text = (f"[{i:03d}] Reference manual for the kettle catalogue, section " * 4)[:100]
        return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]

    # Fill the org's quota (16 blocks: two 6-block prefixes), so its next is refused.
    for i in range(2):
        _, r = small.ask([{"role": "user", "content": "hi"}], system=system(i))
        assert r.usage.cache_creation.ephemeral_1h_input_tokens > 0
    kw = {"system": system(2)}
    _, first = small.ask(TURN1, diagnostics={"previous_message_id": None}, **kw)
    assert first.usage.cache_creation_input_tokens == 0  # refused: billed as input
    _, second = small.ask(TURN2, diagnostics={"previous_message_id": first.id}, **kw)
    assert second.diagnostics is None
    assert second.usage.cache_read_input_tokens == 0
    reason, tokens, detail = small.ledger(second._request_id)
    assert (reason, detail) == ("not_retained", None)
    # What the turn before would have cached, to its last breakpoint: bos, a header, the
    # system text and a separator, then a header, the user text and a separator.
    assert tokens == 1 + 1 + 100 + 1 + 1 + len(U1) + 1


def test_the_same_prompt_under_the_other_scope_is_scope_changed(one):
    engine = make_engine(one.db)
    with make_sessionmaker(engine)() as s:
        org = get_org(s, _org_of(one, "a"))
        set_policy(s, org, allow_global=True)
        s.commit()
    engine.dispose()
    global_system = [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "scope": "global"}}
    ]
    beta = {"anthropic-beta": SCOPE_BETA}
    _, first = one.ask(TURN1, system=global_system, extra_headers=beta, diagnostics=OPT_IN)
    _, second = one.ask(
        TURN1, system=global_system, diagnostics={"previous_message_id": first.id}
    )  # the same prompt, without the scope beta: org scope
    assert second.diagnostics is None  # Anthropic's answer: the prompt did not change
    reason, tokens, _ = one.ledger(second._request_id)
    assert reason == "scope_changed" and tokens > 0


def test_a_cache_key_beta_gone_is_betas_changed(one):
    _, first = one.ask(TURN1, extra_headers={"anthropic-beta": BETA}, diagnostics=OPT_IN)
    _, second = one.ask(TURN1, diagnostics={"previous_message_id": first.id})
    # Anthropic has no such type: a parameter that is not the prompt changed.
    assert second.diagnostics.cache_miss_reason.type == "unavailable"
    assert second.usage.cache_read_input_tokens == 0  # another cache key
    assert one.ledger(second._request_id)[0] == "betas_changed"


def _org_of(stack: Stack, who: str) -> str:
    from cachepoint.gateway.tenancy.tenants import authenticate

    engine = make_engine(stack.db)
    with make_sessionmaker(engine)() as s:
        ctx = authenticate(s, stack.keys[who])
    engine.dispose()
    assert ctx is not None
    return ctx.org_id


def test_another_served_model_is_model_changed(serve, seeded_db):
    """Two replicas serving two models: the same conversation sent to the other model
    shares nothing with the turn before (another model, another KV)."""
    from anthropic.types import CacheMissModelChanged

    db, keys = seeded_db
    urls = [
        serve(create_replica_app(ReplicaSettings(name=f"m{i}", model_name=m), tiny()))
        for i, m in enumerate((MODEL, "cachepoint-tiny-2"))
    ]
    app = create_app(GatewaySettings(database_url=db, replica_urls=urls, min_cacheable_tokens=64))
    url = serve(app)
    wait_for(lambda: len({v.name for v in app.state.directory.views() if v.live}) == 2, "live")
    c = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    kw = {"max_tokens": 2, "system": SYSTEM, "extra_body": {"temperature": 0.0}}
    first = c.messages.create(model=MODEL, messages=TURN1, diagnostics=OPT_IN, **kw)
    second = c.messages.create(
        model="cachepoint-tiny-2",
        messages=TURN2,
        diagnostics={"previous_message_id": first.id},
        **kw,
    )
    reason = second.diagnostics.cache_miss_reason
    assert isinstance(reason, CacheMissModelChanged)
    # Nothing is shared across models: all the turn before cached was missed.
    assert reason.cache_missed_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens == 0
