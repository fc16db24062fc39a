"""Injected 409, 410 and 429 answers, and the operator recovering from each of them."""

from __future__ import annotations

import json
from typing import Any

import kmock
import pytest

from cachepoint.bench.kube.apiserver.faults import Faults
from cachepoint.bench.kube.cluster import (
    CR,
    OPERATOR_API_TOKEN,
    PODS,
    Cluster,
    cache_replica,
    running_operator,
)

AS_OPERATOR = {"Authorization": f"Bearer {OPERATOR_API_TOKEN}"}


def test_a_fault_hits_the_next_n_matching_operator_requests_only() -> None:
    faults = Faults()
    fault = faults.add(429, "create", "pods", count=2)
    assert faults.take("create", "pods", "ns", None, from_operator=False) is None  # the test's
    assert faults.take("create", "services", "ns", None, from_operator=True) is None
    assert faults.take("create", "pods", "ns", None, from_operator=True) is fault
    assert faults.take("create", "pods", "ns", None, from_operator=True) is fault
    assert faults.take("create", "pods", "ns", None, from_operator=True) is None  # used up
    assert fault.hits == 2


def test_only_the_codes_a_server_gives_under_load_or_races() -> None:
    with pytest.raises(ValueError, match="fault code"):
        Faults().add(500, "create", "pods")


async def test_429_carries_retry_after(cluster: Cluster) -> None:
    cluster.server.faults.add(429, "list", "pods", retry_after=3)
    response = await cluster.server.get(cluster.path(PODS), headers=AS_OPERATOR)
    assert response.status == 429
    assert response.headers["Retry-After"] == "3"
    body = await response.json()
    assert (body["reason"], body["details"]["retryAfterSeconds"]) == ("TooManyRequests", 3)
    assert (await cluster.server.get(cluster.path(PODS), headers=AS_OPERATOR)).status == 200


async def test_410_on_a_watch_is_an_expired_error_event(cluster: Cluster) -> None:
    cluster.server.faults.add(410, "watch", "cachereplicas")
    response = await cluster.server.get(cluster.path(CR) + "?watch=true", headers=AS_OPERATOR)
    assert response.status == 200  # the stream starts, then says why it ends
    event = json.loads((await response.text()).splitlines()[0])
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")


async def test_409_on_an_update_is_a_concurrent_write(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    seen = cluster.get("llama")["metadata"]["resourceVersion"]
    status_path = cluster.path(CR, "llama", "status")
    # A merge patch carrying the version it read loses the race: 409.
    cluster.server.faults.add(409, "update", "cachereplicas")
    stale = {"metadata": {"resourceVersion": seen}, "status": {"phase": "Running"}}
    response = await cluster.server.patch(status_path, json=stale, headers=AS_OPERATOR)
    assert response.status == 409
    assert (await response.json())["reason"] == "Conflict"
    assert cluster.get("llama")["metadata"]["resourceVersion"] != seen  # someone wrote
    # kopf's JSON patch, whose resourceVersion test now fails: 422, as a real server says.
    seen = cluster.get("llama")["metadata"]["resourceVersion"]
    cluster.server.faults.add(409, "update", "cachereplicas")
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": seen},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    response = await cluster.server.patch(
        cluster.path(CR, "llama"),
        data=json.dumps(ops),
        headers={**AS_OPERATOR, "Content-Type": "application/json-patch+json"},
    )
    assert response.status == 422
    assert "finalizers" not in cluster.get("llama")["metadata"]
    # A patch without a precondition is applied to the newest object.
    cluster.server.faults.add(409, "update", "cachereplicas")
    plain = {"status": {"phase": "Degraded"}}
    response = await cluster.server.patch(status_path, json=plain, headers=AS_OPERATOR)
    assert response.status == 200
    assert cluster.get("llama")["status"]["phase"] == "Degraded"


async def test_the_operator_retries_pod_creation_after_429(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    fault = cluster.server.faults.add(429, "create", "pods", count=2, retry_after=1)
    await cluster.create(cache_replica("llama", replicas=1))
    await cluster.wait(lambda: list(cluster.pods()) == ["llama-0"], "the member, after 429s", 30)
    assert fault.hits == 2


async def test_the_operator_relists_after_its_watch_expires(
    cluster: Cluster, kubelet: None
) -> None:
    fault = cluster.server.faults.add(410, "watch", "cachereplicas")
    lists = lambda: [  # noqa: E731
        r
        for r in cluster.server
        if r.resource == kmock.resource(CR) and r.action == kmock.action.LIST
    ]
    async with running_operator():
        await cluster.wait(lambda: fault.hits == 1, "the watch to expire")
        await cluster.wait(lambda: len(lists()) >= 2, "a new list after the expiry")
        await cluster.create(cache_replica("llama", replicas=1))
        await cluster.wait(lambda: list(cluster.pods()) == ["llama-0"], "the member")


async def test_the_operator_survives_conflicts_on_its_cache_replica_writes(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    fault = cluster.server.faults.add(409, "update", "cachereplicas", count=3)
    await cluster.create(cache_replica("llama", replicas=1))
    await cluster.wait(
        lambda: (cluster.get("llama") or {}).get("status", {}).get("readyReplicas") == 1,
        "Ready after conflicts",
        30,
    )
    assert fault.hits == 3
