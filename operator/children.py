"""Apply the builders' output to the cluster: the CacheReplica's NetworkPolicy, its
Service, its PodDisruptionBudget and its member pods.

Each function reads what exists, compares it with what the builders want and sends
only the difference, so running it twice changes nothing the second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf

from cachepoint.operator import kube
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.disruption import build_replica_pdb, pdb_drift, pdb_name
from cachepoint.operator.members import Plan, observe, plan
from cachepoint.operator.naming import selector_string, service_name
from cachepoint.operator.network import build_replica_network_policy, network_policy_drift
from cachepoint.operator.pod import build_replica_pod, template_hash
from cachepoint.operator.service import build_replica_service, service_drift
from cachepoint.operator.spec import ReplicaSpec


class ForeignChild(Exception):
    """An object with the name we need exists and belongs to someone else: never touch it."""


def owned_pods(namespace: str, replica: str, uid: str) -> list[dict[str, Any]]:
    """Member pods of this CacheReplica object (not of an older one of the same name)."""
    return [p for p in kube.list_pods(namespace, selector_string(replica)) if kube.owned_by(p, uid)]


def _ensure(
    owner: kopf.Body,
    desired: dict[str, Any],
    kind: str,
    get: Callable[[str, str], dict[str, Any] | None],
    create: Callable[[dict[str, Any]], bool],
    drift: Callable[[dict[str, Any], dict[str, Any]], list[dict[str, Any]]],
    patch: Callable[[str, str, list[dict[str, Any]]], None],
) -> str | None:
    """Create `desired`, or patch what drifted back; what was done, if anything."""
    kopf.adopt(desired, owner=owner)
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = get(namespace, name)
    if current is None:
        return "created" if create(desired) else None
    if not kube.owned_by(current, owner.metadata.uid or ""):
        raise ForeignChild(f"{kind} {name} already exists and is not this CacheReplica's")
    ops = drift(current, desired)
    if ops:
        patch(namespace, name, ops)
        return "updated"
    return None


def ensure_service(owner: kopf.Body, replica: str, namespace: str, spec: ReplicaSpec) -> str | None:
    """Create the Service or bring its ports and selector back."""
    desired = build_replica_service(replica=replica, namespace=namespace, spec=spec)
    return _ensure(
        owner, desired, "Service", kube.get_service, kube.create_service, service_drift,
        kube.patch_service,
    )  # fmt: skip


def ensure_pdb(owner: kopf.Body, replica: str, namespace: str, spec: ReplicaSpec) -> str | None:
    """Create the PodDisruptionBudget or bring its spec back."""
    desired = build_replica_pdb(replica=replica, namespace=namespace, spec=spec)
    return _ensure(
        owner, desired, "PodDisruptionBudget", kube.get_pdb, kube.create_pdb, pdb_drift,
        kube.patch_pdb,
    )  # fmt: skip


def ensure_network_policy(
    owner: kopf.Body, replica: str, namespace: str, config: OperatorConfig
) -> str | None:
    """Create the members' NetworkPolicy or bring its spec back; nothing when the
    operator keeps none (config.network_policy off: no NetworkPolicy call at all)."""
    if not config.network_policy:
        return None
    desired = build_replica_network_policy(replica=replica, namespace=namespace, config=config)
    return _ensure(
        owner, desired, "NetworkPolicy", kube.get_network_policy, kube.create_network_policy,
        network_policy_drift, kube.patch_network_policy,
    )  # fmt: skip


def converge_members(
    owner: kopf.Body,
    replica: str,
    namespace: str,
    uid: str,
    spec: ReplicaSpec,
    config: OperatorConfig,
    *,
    roll: bool,
    pods: list[dict[str, Any]] | None = None,
) -> Plan:
    """One step towards `spec.replicas` members on the current template; the plan taken.

    `pods`: this object's member pods as already known (the timer's index); None lists
    them. NOTE: the roll lists, since its budget counts on seeing its own last deletes.
    """
    wanted = template_hash(spec, config)
    if pods is None:
        pods = owned_pods(namespace, replica, uid)
    step = plan(
        spec.replicas, wanted, observe(pods), roll=roll, max_unavailable=spec.max_unavailable
    )
    for name in step.delete:
        kube.delete_pod(namespace, name)
    for index in step.create:
        pod = build_replica_pod(
            replica=replica, namespace=namespace, index=index, spec=spec, config=config
        )
        kopf.adopt(pod, owner=owner)
        kube.create_pod(pod)
    return step


def remove_children(namespace: str, replica: str, uid: str) -> int:
    """Delete the member pods, the Service and the PodDisruptionBudget this object owns;
    how many objects went.

    NOTE: not the NetworkPolicy: it guards members still terminating, and the garbage
    collector removes it (owner reference) once the CacheReplica itself is gone.
    """
    removed = sum(
        kube.delete_pod(namespace, pod["metadata"]["name"])
        for pod in owned_pods(namespace, replica, uid)
    )
    service = kube.get_service(namespace, service_name(replica))
    if service is not None and kube.owned_by(service, uid):
        removed += kube.delete_service(namespace, service_name(replica))
    # After the pods: a budget without members protects nothing, and none is left to evict.
    budget = kube.get_pdb(namespace, pdb_name(replica))
    if budget is not None and kube.owned_by(budget, uid):
        removed += kube.delete_pdb(namespace, pdb_name(replica))
    return removed
