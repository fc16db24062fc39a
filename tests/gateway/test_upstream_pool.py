"""The gateway reuses its connections to a replica: a response read to its end goes
back to httpx's pool (a new connection per request cost ~1.5 ms, bench/RESULTS.md)."""

from __future__ import annotations

import anthropic

from cachepoint.gateway.app import create_app
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.echo import create_echo_app


def test_sequential_requests_share_one_connection_to_the_replica(serve, seeded_db) -> None:
    echo = create_echo_app("r0", output_tokens=3)
    ports: list[int] = []

    async def recording(scope, receive, send):  # the connection is the client's port
        if scope["type"] == "http" and scope["path"] == "/v1/generate":
            ports.append(scope["client"][1])
        await echo(scope, receive, send)

    replica = serve(recording)
    db, keys = seeded_db
    gateway = serve(create_app(GatewaySettings(database_url=db, replica_urls=[replica])))
    client = anthropic.Anthropic(base_url=gateway, api_key=keys["a"], max_retries=0)
    body = {"model": "cachepoint-tiny", "max_tokens": 3}
    body["messages"] = [{"role": "user", "content": "hello"}]
    for _ in range(4):
        assert client.messages.create(**body).usage.output_tokens == 3
        with client.messages.stream(**body) as stream:
            assert stream.get_final_message().usage.output_tokens == 3
    assert len(ports) == 8
    # NOTE: at most two: a health or stats poll may hold the pooled one for a moment.
    assert len(set(ports)) <= 2, ports
