"""Pure builder for a CacheReplica's NetworkPolicy, and its drift.

Members serve /v1/generate, /v1/stats and /metrics on their one `http` port. The policy
lets in only what calls them: the release's gateway (requests) and operator (stats
polls), both from the release namespace, and the metrics scrapers
(`networkPolicy.metricsFrom`). It lives in the CacheReplica's namespace, whichever that
is, so members outside the namespaces the chart renders into are covered too; the
internal token still guards /v1/generate and /v1/stats behind it.
"""

from __future__ import annotations

from typing import Any

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.naming import PORT_NAME, common_labels

# The label the API server puts on every namespace (Kubernetes 1.21+): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def network_policy_name(replica: str) -> str:
    # NOTE: not the bare name, as the Service and the budget: a namespace's own policies
    # are often named after the app, and a clash would hold the CacheReplica back.
    return f"{replica}-ingress"


def replica_ingress_peers(config: OperatorConfig) -> list[dict[str, Any]]:
    """Who may reach the members' http port: the chart's replicas policy, peer for peer."""
    release = {"matchLabels": {NAMESPACE_NAME_LABEL: config.release_namespace}}
    peers = [
        {"namespaceSelector": release, "podSelector": {"matchLabels": dict(labels)}}
        for labels in (config.gateway_pod_labels, config.operator_pod_labels)
    ]
    return peers + [dict(peer) for peer in config.metrics_from]


def build_replica_network_policy(
    *, replica: str, namespace: str, config: OperatorConfig
) -> dict[str, Any]:
    """Ingress to the members of one CacheReplica: the http port, from the peers only.

    The port by name, as the members declare it: a new `spec.port` needs no new policy.
    Egress is left alone (members reach NATS, the collector and model storage).
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(replica),
            "namespace": namespace,
            "labels": common_labels(replica),
        },
        "spec": {
            "podSelector": {"matchLabels": common_labels(replica)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "ports": [{"port": PORT_NAME, "protocol": "TCP"}],
                    "from": replica_ingress_peers(config),
                }
            ],
        },
    }


def network_policy_drift(current: dict[str, Any], desired: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch ops that bring the live policy's spec back to the desired one.

    The whole spec at once: a rule or peer added by hand only ever widens what gets in
    (NetworkPolicy rules are a union), so nothing of it may linger.
    """
    if current.get("spec") == desired["spec"]:
        return []
    return [{"op": "replace", "path": "/spec", "value": desired["spec"]}]
