"""The gateway's /metrics in the chart: its own port, apart from the API, with the pod's
scrape annotations pointing at it."""

from __future__ import annotations

from typing import Any

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.network import build_replica_network_policy

from .conftest import render
from .test_chart import FULLNAME, one


def _gateway(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = one(docs, "Deployment", f"{FULLNAME}-gateway")
    return dep["spec"]["template"], dep["spec"]["template"]["spec"]["containers"][0]


def test_gateway_metrics_have_their_own_port_and_scrape_annotations(helm: str) -> None:
    template, container = _gateway(render(helm, "default"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "metrics": 9464}
    assert "--metrics-port=9464" in container["args"]
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == "9464"
    assert notes["prometheus.io/path"] == "/metrics"


def test_gateway_metrics_port_zero_turns_them_off(helm: str) -> None:
    template, container = _gateway(render(helm, "default", "--set", "gateway.metricsPort=0"))
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert not any(a.startswith("--metrics-port") for a in container["args"])
    assert "prometheus.io/scrape" not in template["metadata"]["annotations"]


def _ingress(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = one(docs, "NetworkPolicy", name)["spec"]["ingress"]
    return rules


def _replica_peers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Who the operator lets reach a member's http port, with the rendered settings."""
    container = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"][
        "containers"
    ][0]
    config = OperatorConfig.from_env(
        {e["name"]: e["value"] for e in container["env"] if "value" in e}
    )
    policy = build_replica_network_policy(replica="llama", namespace="team-a", config=config)
    (rule,) = policy["spec"]["ingress"]
    peers: list[dict[str, Any]] = rule["from"]
    return peers


def test_network_policy_lets_only_scrapers_reach_metrics(helm: str) -> None:
    docs = render(helm, "default")
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    gateway = _ingress(docs, f"{FULLNAME}-gateway")
    api = next(r for r in gateway if r["ports"][0]["port"] == "http")
    scrape = next(r for r in gateway if r["ports"][0]["port"] == "metrics")
    assert "from" not in api  # the API is public
    assert scrape["from"] == [monitoring]  # the billing totals are not
    # Replicas serve /metrics on their http port: scrapers join the gateway and operator
    # in each CacheReplica's policy, which the operator builds from these settings.
    assert monitoring in _replica_peers(docs)

    closed = render(helm, "default", "--set", "networkPolicy.metricsFrom=null")
    assert [r["ports"][0]["port"] for r in _ingress(closed, f"{FULLNAME}-gateway")] == ["http"]
    assert monitoring not in _replica_peers(closed)
    assert len(_replica_peers(closed)) == 2  # the gateway and the operator
