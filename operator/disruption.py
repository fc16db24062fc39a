"""Pure builder for a CacheReplica's PodDisruptionBudget, and its drift.

Voluntary disruptions (node drains, cluster autoscaler scale-downs) evict pods through
the eviction API, which honours the budget; the operator's own deletes during a roll do
not go through it and are bounded by the member plan (members.py) with the same
`spec.rollout.maxUnavailable`.
"""

from __future__ import annotations

from typing import Any

from cachepoint.operator.naming import common_labels
from cachepoint.operator.spec import ReplicaSpec


def pdb_name(replica: str) -> str:
    return replica


def build_replica_pdb(*, replica: str, namespace: str, spec: ReplicaSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": pdb_name(replica),
            "namespace": namespace,
            "labels": common_labels(replica),
        },
        "spec": {
            "maxUnavailable": spec.max_unavailable,
            "selector": {"matchLabels": common_labels(replica)},
            # NOTE: a member that is not ready serves nothing; with the default
            # (IfHealthyBudget) a crash-looping member would block every node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def pdb_drift(current: dict[str, Any], desired: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch ops that bring the live budget's spec to the desired one (policy/v1
    budgets are mutable); replace, so a selector label we dropped does not linger."""
    ops = []
    have = current.get("spec") or {}
    for key, want in desired["spec"].items():
        if have.get(key) != want:
            op = "replace" if key in have else "add"
            ops.append({"op": op, "path": f"/spec/{key}", "value": want})
    return ops
