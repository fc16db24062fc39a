"""Per-model gateway settings through the chart: `gateway.settings.modelProfiles` becomes
CACHEPOINT_GATEWAY_MODEL_PROFILES (JSON) that the gateway reads back as it was written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cachepoint.gateway.profiles import profile_of
from cachepoint.gateway.settings import GatewaySettings

from .conftest import CHART, KUBE_VERSION, RELEASE, render, run_helm

PROFILES = {
    "llama-3-8b": {"context_window": 8192, "stop_token_ids": [128008, 128009]},
    "llama-3-70b": {"min_cacheable_tokens": 2048},
}


def _gateway_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (gw,) = (
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{RELEASE}-cachepoint-gateway"
    )
    container = gw["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_model_profiles_render_as_the_json_env_the_gateway_reads(
    helm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = render(
        helm,
        "default",
        "--set-json",
        'gateway.settings.models=["llama-3-8b","llama-3-70b"]',
        "--set-json",
        f"gateway.settings.modelProfiles={json.dumps(PROFILES)}",
    )
    env = _gateway_env(docs)
    raw = env["CACHEPOINT_GATEWAY_MODEL_PROFILES"]
    assert json.loads(raw) == PROFILES
    monkeypatch.setenv("CACHEPOINT_GATEWAY_MODEL_PROFILES", raw)
    monkeypatch.setenv("CACHEPOINT_GATEWAY_MODELS", env["CACHEPOINT_GATEWAY_MODELS"])
    settings = GatewaySettings(min_cacheable_tokens=1024, max_context_tokens=4096)
    small, big = profile_of(settings, "llama-3-8b"), profile_of(settings, "llama-3-70b")
    assert (small.context_window, small.min_cacheable_tokens) == (8192, 1024)
    assert small.stop_token_ids == (128008, 128009)
    assert (big.context_window, big.min_cacheable_tokens, big.stop_token_ids) == (4096, 2048, ())


@pytest.mark.parametrize(
    "bad",
    [
        {"m": {"context_windw": 8192}},  # a typo
        {"m": {"context_window": 8}},
        {"m": {"stop_token_ids": [-1]}},
        {"m": {"stop_token_ids": list(range(17))}},
    ],
)
def test_schema_rejects_bad_model_profiles(helm: str, bad: dict[str, Any]) -> None:
    with pytest.raises(AssertionError, match="failed"):
        run_helm(
            helm,
            "template",
            RELEASE,
            CHART,
            "--kube-version",
            KUBE_VERSION,
            "--set-json",
            f"gateway.settings.modelProfiles={json.dumps(bad)}",
        )
