"""The gateway calls replicas with the internal token, and only then are they served."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from cachepoint.gateway.app import create_app
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

TOKEN = "shared-internal-token"


@pytest.fixture
def replica(serve, tiny_engine) -> str:
    return serve(create_replica_app(ReplicaSettings(name="r0", internal_token=TOKEN), tiny_engine))


def gateway(serve, seeded_db, replica: str, token: str | None) -> tuple[str, dict[str, str]]:
    db, keys = seeded_db
    settings = GatewaySettings(
        database_url=db, replica_urls=[replica], min_cacheable_tokens=64, internal_token=token
    )
    return serve(create_app(settings)), keys


def test_gateway_with_the_token_serves_and_bills(serve, seeded_db, replica: str) -> None:
    url, keys = gateway(serve, seeded_db, replica, TOKEN)
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    reply = client.messages.create(
        model="cachepoint-tiny", max_tokens=3, messages=[{"role": "user", "content": "hello"}]
    )
    assert reply.usage.output_tokens >= 1
    assert reply.usage.input_tokens > 0
    # The replica saw the prompt: the stats poll (also authenticated) reports it.
    stats = httpx.get(f"{replica}/v1/stats", headers={"authorization": f"Bearer {TOKEN}"})
    assert stats.json()["query_tokens"] >= reply.usage.input_tokens


def test_gateway_without_the_token_gets_nothing_from_the_replica(
    serve, seeded_db, replica: str
) -> None:
    url, keys = gateway(serve, seeded_db, replica, None)
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(
            model="cachepoint-tiny", max_tokens=3, messages=[{"role": "user", "content": "hello"}]
        )
    # A clean Anthropic error, never a 500 or a generated (and unbilled) answer: the
    # replica refused the gateway's stats polls, so it never entered routing.
    assert err.value.status_code == 529, err.value.body
    assert err.value.body["error"]["type"] == "overloaded_error"
    stats = httpx.get(f"{replica}/v1/stats", headers={"authorization": f"Bearer {TOKEN}"})
    assert stats.json()["query_tokens"] == 0
