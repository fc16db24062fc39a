"""``entry_evicted``, produced for real: a vLLM replica without Cachepoint's retention
connector (``--no-vllm-retention``: vLLM's own LRU decides, answers say
``retention: best_effort``) behind a gateway on its NATS. A turn writes its prefix,
other tenants' prompts press the small pool until vLLM evicts it, and the next turn,
whose prompt only appended, reads nothing: the ledger says ``entry_evicted`` and the
tier its first missed block was last in, from the replica's own `removed` events.

(On the torch engine, and on vLLM with the connector, a retained entry is never
evicted before its TTL: tests/replica/vllm_engine/test_retention_live.py.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from sqlalchemy import select

from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.models import UsageRecord
from cachepoint.gateway.db.session import make_engine
from cachepoint.gateway.settings import GatewaySettings

from ..conftest import VLLM_BLOCK, VllmReplica, running_vllm_replica
from ..events.test_event_plane import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_best_effort")]

MODEL = "cachepoint-tiny"
POOL_TOKENS = 160 * VLLM_BLOCK  # what 20 MiB holds of the small preset (4 KiB a token)
SYSTEM = "You are the support agent for a company that sells kettles. " * 4


@pytest.fixture(scope="module")
def best_effort(tmp_path_factory) -> Iterator[VllmReplica]:
    with running_vllm_replica(
        tmp_path_factory.mktemp("vllm-best-effort"),
        "--kv-budget", "20MiB", "--max-model-len", "2048", "--no-vllm-retention",
        name="vllm-be",
    ) as replica:  # fmt: skip
        yield replica


def test_an_entry_vllm_evicted_is_entry_evicted_with_its_tier(best_effort, seeded_db, serve):
    db, keys = seeded_db
    settings = GatewaySettings(
        database_url=db,
        nats_url=best_effort.nats_url,
        block_size=VLLM_BLOCK,
        min_cacheable_tokens=64,
        heartbeat_interval_s=0.5,
    )
    app = create_app(settings)
    url = serve(app)
    wait_for(lambda: any(v.live for v in app.state.directory.views()), "the replica live")
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)

    def ask(messages: list[dict], **kw: Any):
        return client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            messages=messages,
            extra_body={"temperature": 0.0},
            **kw,
        )

    question = [{"role": "user", "content": "Where is my order #1234?"}]
    raw = ask(question, diagnostics={"previous_message_id": None})
    first = raw.parse()
    written = first.usage.cache_creation_input_tokens
    assert written > 0 and raw.headers["cachepoint-replica"] == "vllm-be"
    stats = best_effort.stats()
    assert stats["retention"] == "best_effort"

    # Other tenants' distinct prompts, three times the pool, straight to the replica.
    flood, i = 0, 0
    while flood < 3 * POOL_TOKENS:
        rng = random.Random(100 + i)
        tokens = [rng.randrange(0, 256) for _ in range(1600)]
        body = {
            "token_ids": tokens,
            "key_spans": [{"start_block": 0, "extra_keys": [f"model:{MODEL}", f"org:flood{i}"]}],
            "max_tokens": 1,
        }
        assert httpx.post(f"{best_effort.url}/v1/generate", json=body, timeout=180).is_success
        flood += len(tokens)
        i += 1

    follow = [*question, {"role": "assistant", "content": "It ships."}]
    follow.append({"role": "user", "content": "Can I change the address?"})
    raw = ask(follow, diagnostics={"previous_message_id": first.id})
    second = raw.parse()
    assert second.diagnostics is None  # the prompt only appended
    assert second.usage.cache_read_input_tokens == 0  # evicted: written again
    assert second.usage.cache_creation_input_tokens > 0
    engine = make_engine(db)
    with engine.connect() as conn:
        row = conn.execute(
            select(UsageRecord.miss_reason, UsageRecord.miss_tokens, UsageRecord.miss_detail).where(
                UsageRecord.request_id == raw.headers["request-id"]
            )
        ).one()
    engine.dispose()
    assert tuple(row) == ("entry_evicted", written, "tier device")
