"""The operator's NATS permissions are the event plane's, subject for subject.

The operator may not import service code, so operator/nats_auth.py keeps its own copy
of the permission sets that services/events/auth.py builds (and the chart's seed file a
third, written by the operator's builder). Tests may import both: renaming a subject on
one side fails here instead of silently locking replicas out of the cluster's NATS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachepoint.events import auth, subjects
from cachepoint.operator.naming import GATEWAY_NATS_USER, replica_process_name
from cachepoint.operator.nats_auth import (
    GATEWAY_PERMISSIONS,
    build_users_conf,
    member_users,
    replica_permissions,
)

SEED = Path(__file__).parents[2] / "charts" / "cachepoint" / "files" / "nats-users-seed.conf"
NAMES = [
    replica_process_name("serving", "llama-0"),
    replica_process_name("team-a", "x-12"),
    replica_process_name("ml", "qwen-coder-3"),
]


def as_operator_writes(user: auth.NatsUser) -> dict[str, Any]:
    """An event-plane user's permissions in the shape of the operator's users.conf."""
    permissions: dict[str, Any] = {
        "publish": {"allow": list(user.publish)},
        "subscribe": {"allow": list(user.subscribe)},
    }
    if user.allow_responses:
        permissions["allow_responses"] = True
    return permissions


@pytest.mark.parametrize("name", NAMES)
def test_replica_permissions_equal_the_event_planes(name: str) -> None:
    # The operator's user names are valid replica names (single subject tokens).
    assert subjects.check_replica_name(name) == name
    assert replica_permissions(name) == as_operator_writes(auth.replica_user(name, "pw"))
    assert replica_permissions(name) == {
        "publish": {"allow": [subjects.kv_subject(name), subjects.heartbeat_subject(name)]},
        "subscribe": {"allow": [subjects.snapshot_subject(name)]},
        "allow_responses": True,
    }


def test_gateway_permissions_equal_the_event_planes() -> None:
    assert GATEWAY_NATS_USER == auth.GATEWAY_USER
    assert as_operator_writes(auth.gateway_user("pw")) == GATEWAY_PERMISSIONS
    assert GATEWAY_PERMISSIONS == {
        "publish": {"allow": [subjects.SNAPSHOT_ALL]},
        "subscribe": {"allow": [subjects.KV_ALL, subjects.HEARTBEAT_ALL, auth.INBOX_ALL]},
    }


def test_the_users_file_grants_what_the_event_plane_grants() -> None:
    conf = build_users_conf(member_users("serving", {"llama-0": "p" * 24}))
    name = NAMES[0]
    replica = auth.replica_user(name, "pw")
    assert f'"{subjects.kv_subject(name)}", "{subjects.heartbeat_subject(name)}"' in conf
    assert f'"subscribe": {{"allow": ["{replica.subscribe[0]}"]}}' in conf


def test_the_charts_seed_file_is_the_operators_build_for_no_members() -> None:
    # tests/charts checks the rendered Secret too, but only where helm is installed.
    assert SEED.read_text() == build_users_conf({})


# What the operator calls on the Kubernetes API (operator/kube.py and kopf), and why.
OPERATOR_CALLS = {
    # kopf: watch, handle (finalizer and progress annotations), status; kube.py: get.
    ("cachepoint.dev", "cachereplicas", "get"),
    ("cachepoint.dev", "cachereplicas", "list"),
    ("cachepoint.dev", "cachereplicas", "watch"),
    ("cachepoint.dev", "cachereplicas", "patch"),
    ("cachepoint.dev", "cachereplicas/status", "get"),
    ("cachepoint.dev", "cachereplicas/status", "patch"),
    # kopf.adopt sets blockOwnerDeletion: with OwnerReferencesPermissionEnforcement
    # (OpenShift) a child's create needs update on the owner's finalizers.
    ("cachepoint.dev", "cachereplicas/finalizers", "update"),
    # The roll lists; the pod index (handlers.member_pods) lists once, then watches.
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "pods", "create"),
    ("", "pods", "delete"),
    *(("", "services", v) for v in ("get", "create", "patch", "delete")),
    *(("policy", "poddisruptionbudgets", v) for v in ("get", "create", "patch", "delete")),
    ("", "events", "create"),
    *(("", "secrets", v) for v in ("get", "create", "patch", "delete")),
    # Each CacheReplica's NetworkPolicy (the chart's default networkPolicy.enabled); the
    # garbage collector deletes it, the operator never does.
    *(("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")),
}


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_charts_operator_rules_grant_exactly_the_operators_calls() -> None:
    from cachepoint.bench.kube.apiserver.chart import rendered_rbac

    roles = {
        d["metadata"]["name"]: d for d in rendered_rbac() if d["kind"] in ("ClusterRole", "Role")
    }
    # NOTE: kopf's peering grants (kopf.dev) depend on operator.replicas and have their
    # own helper and checks (cachepoint.operatorPeeringRules); not the handlers' calls.
    granted = {g for g in _grants(roles["rel-cachepoint-operator"]["rules"]) if g[0] != "kopf.dev"}
    assert granted - OPERATOR_CALLS == set(), "granted but never called (least privilege)"
    assert OPERATOR_CALLS - granted == set(), "called but not granted (403 in a cluster)"
