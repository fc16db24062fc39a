"""The replica's internal token: /v1/generate and /v1/stats serve only the gateway.

Finding: a replica's /v1/generate served anyone who reached it, skipping billing.
"""

from __future__ import annotations

import httpx
import pytest

from cachepoint.engine import Engine
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings

TOKEN = "t0ken-for-the-gateway-only"
BODY = {"token_ids": list(range(1, 40)), "max_tokens": 2}


@pytest.fixture
def base_url(engine: Engine, sink, serve) -> str:
    settings = ReplicaSettings(name="r-auth", internal_token=TOKEN, max_num_batched_tokens=256)
    return serve(create_app(settings, engine, sink=sink))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Bearer {TOKEN}x"},
        {"authorization": TOKEN},  # no scheme
        {"authorization": f"Basic {TOKEN}"},
        {"x-api-key": TOKEN},
    ],
    ids=["none", "wrong", "longer", "no-scheme", "basic", "other-header"],
)
def test_generate_and_stats_refuse_calls_without_the_token(
    base_url: str, headers: dict[str, str]
) -> None:
    r = httpx.post(f"{base_url}/v1/generate", json=BODY, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or wrong internal token"},
    }
    s = httpx.get(f"{base_url}/v1/stats", headers=headers)
    assert s.status_code == 401
    assert s.json()["error"]["type"] == "authentication_error"
    # Even an invalid body is refused for lack of the token first (no schema oracle).
    bad = httpx.post(f"{base_url}/v1/generate", json={"nope": 1}, headers=headers)
    assert bad.status_code == 401
    # Refused before any work: the replica never saw a prompt token.
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{base_url}/v1/stats", headers=auth).json()["query_tokens"] == 0


def test_the_right_token_is_served_and_probes_stay_open(base_url: str) -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{base_url}/v1/generate", json=BODY, headers=auth)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_token_ids"]) == 2
    assert httpx.get(f"{base_url}/v1/stats", headers=auth).json()["replica"] == "r-auth"
    # Kubelet probes and Prometheus carry no token.
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{base_url}{path}").status_code == 200, path


def test_the_token_comes_from_the_shared_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("CACHEPOINT_INTERNAL_TOKEN", "from-env")
    assert ReplicaSettings().internal_token.get_secret_value() == "from-env"
    assert "from-env" not in repr(ReplicaSettings())  # a SecretStr: never logged
