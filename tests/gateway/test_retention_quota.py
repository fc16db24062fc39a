"""One org must not take all the TTL retention of a replica.

A real replica (tiny model, CPU, a deliberately small pool of 64 blocks, so 32 may be
retained) behind a real gateway on SQLite, driven by the official SDK. Org a writes
distinct 1h prefixes until the replica refuses to retain more; org b's next new
prefix must still be written, and read on repeat. Before the per-org quota, org a
filled the whole retained budget and org b got neither.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import get_org

MODEL = "cachepoint-tiny"
NUM_BLOCKS = 64  # retained budget: 32 blocks; default org quota: 16
# 100 bytes of system text: a breakpoint at 103 tokens (bos, header, text, separator),
# so 6 full blocks of 16 per prefix: org a's quota of 16 holds 2 such prefixes.
PREFIX_BLOCKS = 6
ORG_QUOTA = 16
FILLER = "Reference manual for the kettle catalogue, section "


def system_text(org: str, i: int) -> str:
    head = f"[{org}:{i:03d}] {FILLER}"
    return (head * 4)[:100]


@pytest.fixture
def small_stack(seeded_db, serve):
    from cachepoint.engine import Engine, EngineConfig, ModelConfig
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings
    from cachepoint.replica.api.app import create_app as create_replica_app
    from cachepoint.replica.settings import ReplicaSettings

    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    engine = Engine(cfg, EngineConfig(kv_cache_bytes=NUM_BLOCKS * per_block, max_model_len=512))
    assert engine.num_blocks == NUM_BLOCKS
    replica = serve(create_replica_app(ReplicaSettings(name="r0", retained_share=0.5), engine))
    db, keys = seeded_db
    settings = GatewaySettings(database_url=db, replica_urls=[replica], min_cacheable_tokens=64)
    return {"url": serve(create_app(settings)), "keys": keys, "replica": replica, "db": db}


def ask(stack, who: str, system: str) -> anthropic.types.Usage:
    c = anthropic.Anthropic(base_url=stack["url"], api_key=stack["keys"][who], max_retries=0)
    r = c.messages.create(
        model=MODEL,
        max_tokens=2,
        system=[
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        messages=[{"role": "user", "content": "hi"}],
    )
    return r.usage


def test_one_org_cannot_starve_another_of_retention(small_stack):
    # Org a writes new 1h prefixes until one is refused (billed as plain input).
    written = 0
    refused = None
    for i in range(12):
        u = ask(small_stack, "a", system_text("a", i))
        if u.cache_creation_input_tokens == 0:
            refused = (i, u)
            break
        assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
        written += 1
    assert refused is not None, "org a was never refused: the pool is not small enough"
    assert written == ORG_QUOTA // PREFIX_BLOCKS
    i, u = refused
    assert u.cache_read_input_tokens == 0
    assert u.input_tokens > 100  # the refused prefix is billed as input, never as a write
    # Org a's quota is half the retained budget; the rest is still free for others.
    stats = httpx.get(f"{small_stack['replica']}/v1/stats").json()
    assert stats["blocks"]["max_retained"] == 2 * ORG_QUOTA
    assert stats["blocks"]["retained"] == written * PREFIX_BLOCKS
    # A refused prefix stays unwritten: its repeat is not a read either.
    again = ask(small_stack, "a", system_text("a", i))
    assert again.cache_read_input_tokens == 0
    assert again.cache_creation_input_tokens == 0

    # Org b's new prefix is written, then read on repeat.
    first = ask(small_stack, "b", system_text("b", 0))
    assert first.cache_creation.ephemeral_1h_input_tokens > 100
    repeat = ask(small_stack, "b", system_text("b", 0))
    assert repeat.cache_read_input_tokens == first.cache_creation_input_tokens
    assert repeat.cache_creation_input_tokens == 0


def test_per_org_share_set_by_admin_reaches_the_replica(small_stack):
    """`orgs set-retention a --share 0` (stored on the org row) stops every write of a;
    b, on the default share, is unaffected."""
    engine = make_engine(small_stack["db"])
    with make_sessionmaker(engine)() as s:
        get_org(s, "a").retained_share = 0.0
        s.commit()
    engine.dispose()
    u = ask(small_stack, "a", system_text("a", 0))
    assert u.cache_creation_input_tokens == 0
    assert u.input_tokens > 100
    b = ask(small_stack, "b", system_text("b", 0))
    assert b.cache_creation_input_tokens > 100
