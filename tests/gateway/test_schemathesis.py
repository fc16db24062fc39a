"""Schemathesis against the gateway's own OpenAPI spec: no input may cause a 5xx.

NOTE: schemathesis' pytest plugin (from_fixture) does not load under pytest 9, so the
operations are driven through its Python API: one hypothesis run per operation.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from cachepoint.gateway.app import create_app
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.echo import create_echo_app


def _fuzz(op: Any, key: str, statuses: set[tuple[str, int]]) -> int:
    """Run one operation's generated cases; returns how many were sent."""
    sent = 0

    @given(case=op.as_strategy())
    @settings(
        max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    def check(case: Any) -> None:
        nonlocal sent
        # Random model ids would stop every request at the 404; go deeper.
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "cachepoint-tiny"
        response = case.call(headers={"x-api-key": key})
        sent += 1
        statuses.add((op.path, response.status_code))
        assert response.status_code < 500, f"{case.method} {case.path}: {response.text[:300]}"

    check()
    return sent


@pytest.mark.slow
def test_schemathesis_no_server_errors(seeded_db, serve):
    db, keys = seeded_db
    replica = serve(create_echo_app())
    # NOTE: the spec is served only with api_docs (off by default).
    settings = GatewaySettings(database_url=db, replica_urls=[replica], api_docs=True)
    url = serve(create_app(settings))
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    statuses: set[tuple[str, int]] = set()
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        key = keys["a-admin"] if "/organizations/" in op.path else keys["a"]
        sent[op.path] = _fuzz(op, key, statuses)
    assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/models"} <= set(sent)
    # OpenAI's endpoints are fuzzed the same way: bad input is a 4xx, never a 5xx.
    assert {"/v1/chat/completions", "/v1/completions"} <= set(sent)
    assert all(n > 0 for n in sent.values())
    # Generated bodies reached the replica and back, not only validation errors.
    assert ("/v1/messages", 200) in statuses
    assert ("/v1/messages", 400) in statuses
