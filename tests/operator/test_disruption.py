"""The PodDisruptionBudget builder and its drift, and refused creates read from the API."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from kubernetes.client.exceptions import ApiException

from cachepoint.operator import kube
from cachepoint.operator.disruption import build_replica_pdb, pdb_drift
from cachepoint.operator.naming import common_labels
from cachepoint.operator.spec import check

K8S_VERSION = "1.31.0"


def spec(**fields: Any) -> Any:
    return check("llama", {"image": "img:1", "model": {"name": "m"}, **fields})


def test_the_budget_covers_the_members_with_the_rollout_bound() -> None:
    pdb = build_replica_pdb(
        replica="llama", namespace="serving", spec=spec(rollout={"maxUnavailable": 2})
    )
    kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "llama"
    assert pdb["spec"]["maxUnavailable"] == 2
    assert pdb["spec"]["selector"] == {"matchLabels": common_labels("llama")}
    # A member that is not ready must never block a node drain.
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert (
        build_replica_pdb(replica="llama", namespace="serving", spec=spec())["spec"][
            "maxUnavailable"
        ]
        == 1
    )


def test_pdb_drift_replaces_only_what_changed() -> None:
    current = build_replica_pdb(replica="llama", namespace="serving", spec=spec())
    assert pdb_drift(current, current) == []
    wider = build_replica_pdb(
        replica="llama", namespace="serving", spec=spec(rollout={"maxUnavailable": 3})
    )
    assert pdb_drift(current, wider) == [
        {"op": "replace", "path": "/spec/maxUnavailable", "value": 3}
    ]
    # A budget edited by hand (minAvailable style, policy dropped) is put back.
    edited = {"spec": {"selector": current["spec"]["selector"], "maxUnavailable": 1}}
    assert pdb_drift(edited, current) == [
        {"op": "add", "path": "/spec/unhealthyPodEvictionPolicy", "value": "AlwaysAllow"}
    ]


def _refusing(status: int, message: str) -> Any:
    def create(namespace: str, body: dict[str, Any], **_: Any) -> Any:
        error = ApiException(status=status, reason="Forbidden")
        error.body = json.dumps({"kind": "Status", "code": status, "message": message})
        raise error

    return create


@pytest.mark.parametrize("status", [400, 403, 404, 422])
def test_a_refused_create_carries_the_apis_message(status: int) -> None:
    pod = {"metadata": {"name": "llama-0", "namespace": "serving"}}
    message = 'pods "llama-0" is forbidden: exceeded quota: gpus, requested: 8, limited: 4'
    with pytest.raises(kube.CreateRejected) as caught:
        kube._create("Pod", _refusing(status, message), pod)
    assert caught.value.kind == "Pod"
    assert caught.value.message == f"create Pod llama-0: {status} {message}"
    assert isinstance(caught.value, ApiException)  # callers that know only those still work


@pytest.mark.parametrize("status", [409, 429, 500])
def test_exists_throttled_and_server_errors_are_no_refusal(status: int) -> None:
    pod = {"metadata": {"name": "llama-0", "namespace": "serving"}}
    if status == 409:
        assert kube._create("Pod", _refusing(status, "exists"), pod) is False
        return
    with pytest.raises(ApiException) as caught:
        kube._create("Pod", _refusing(status, "later"), pod)
    assert not isinstance(caught.value, kube.CreateRejected)


def test_a_refusal_without_a_status_body_falls_back_to_the_reason() -> None:
    def create(namespace: str, body: dict[str, Any], **_: Any) -> Any:
        raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(kube.CreateRejected) as caught:
        kube._create("Service", create, {"metadata": {"name": "llama", "namespace": "s"}})
    assert caught.value.message == "create Service llama: 403 Forbidden"
