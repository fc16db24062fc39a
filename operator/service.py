"""Pure builder for the headless Service in front of a CacheReplica's members."""

from __future__ import annotations

from typing import Any

from cachepoint.operator.naming import PORT_NAME, common_labels, selector_labels, service_name
from cachepoint.operator.spec import ReplicaSpec


def build_replica_service(*, replica: str, namespace: str, spec: ReplicaSpec) -> dict[str, Any]:
    """Headless on purpose: the gateway routes each request to the member that holds its
    prefix, so a virtual IP that load-balances would defeat the cache. The Service gives
    per-member DNS records (with the pods' hostname/subdomain) and scrape discovery."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(replica),
            "namespace": namespace,
            "labels": common_labels(replica),
        },
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(replica),
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": PORT_NAME, "port": spec.port, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def service_drift(current: dict[str, Any], desired: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch ops that bring the live Service's selector and ports to the desired ones.

    Replace, not merge: a strategic merge of `ports` keys on the port number and would
    keep the old port alongside a new one.
    """
    ops = []
    for field in ("selector", "ports"):
        want = desired["spec"][field]
        if current.get("spec", {}).get(field) != want:
            ops.append({"op": "replace", "path": f"/spec/{field}", "value": want})
    return ops
