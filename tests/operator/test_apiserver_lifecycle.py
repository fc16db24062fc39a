"""Deletion as a real API server does it: deletionTimestamp, pod grace periods, finalizers,
owner-reference garbage collection, and optimistic concurrency on resourceVersion."""

from __future__ import annotations

import json
from typing import Any

import kmock

from cachepoint.bench.kube.apiserver import lifecycle
from cachepoint.bench.kube.cluster import CR, NAMESPACE, PODS, SERVICES, Cluster, cache_replica

MERGE = {"Content-Type": "application/merge-patch+json"}


def pod(name: str, owner: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


async def post(cluster: Cluster, resource: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await cluster.server.post(cluster.path(resource), json=body)
    assert response.status == 201, await response.text()
    return await response.json()


async def patch(cluster: Cluster, resource: str, name: str, body: Any) -> Any:
    return await cluster.server.patch(
        cluster.path(resource, name), data=json.dumps(body), headers=MERGE
    )


def test_pod_grace_comes_from_the_request_then_the_spec_then_30s() -> None:
    running = {"spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    assert lifecycle.pod_grace(running, None) == 30
    assert lifecycle.pod_grace(running, 5) == 5
    assert (
        lifecycle.pod_grace(
            {**running, "spec": {"nodeName": "n", "terminationGracePeriodSeconds": 90}}, None
        )
        == 90
    )
    # Never scheduled, or already finished: nothing to stop, so no grace.
    assert lifecycle.pod_grace({"spec": {}}, 5) == 0
    assert lifecycle.pod_grace({**running, "status": {"phase": "Failed"}}, None) == 0


async def test_a_running_pod_is_marked_then_removed_when_the_kubelet_confirms(
    cluster: Cluster,
) -> None:
    await post(cluster, PODS, pod("p", nodeName="node-1"))
    response = await cluster.server.delete(cluster.path(PODS, "p"))
    assert response.status == 200
    marked = cluster.get("p", PODS)
    assert marked is not None
    assert marked["metadata"]["deletionTimestamp"]
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 30
    # A second delete with a shorter grace (kubectl --grace-period=0 --force) removes it.
    response = await cluster.server.delete(cluster.path(PODS, "p"), json={"gracePeriodSeconds": 0})
    assert response.status == 200
    assert cluster.get("p", PODS) is None


async def test_the_fake_kubelet_finishes_terminating_pods(cluster: Cluster, kubelet: None) -> None:
    await post(cluster, PODS, pod("p"))
    await cluster.wait(lambda: (cluster.get("p", PODS) or {}).get("status", {}).get("podIP"), "up")
    assert cluster.get("p", PODS)["spec"]["nodeName"]  # bound, so deletion is graceful
    await cluster.server.delete(cluster.path(PODS, "p"))
    await cluster.wait(lambda: cluster.get("p", PODS) is None, "pod gone")


async def test_finalizers_hold_an_object_until_they_are_removed(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    assert (await patch(cluster, CR, "llama", {"metadata": {"finalizers": ["x/y"]}})).status == 200
    await cluster.delete("llama")
    held = cluster.get("llama")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    # No new finalizers on an object being deleted.
    more = await patch(cluster, CR, "llama", {"metadata": {"finalizers": ["x/y", "a/b"]}})
    assert more.status == 422
    assert "no new finalizers can be added" in (await more.json())["message"]
    assert (await patch(cluster, CR, "llama", {"metadata": {"finalizers": None}})).status == 200
    assert cluster.get("llama") is None


async def test_dependents_are_garbage_collected_with_their_owner(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    owner = cluster.get("llama")
    assert owner is not None
    await post(cluster, PODS, pod("llama-0", owner, nodeName="node-1"))
    await post(cluster, PODS, pod("unowned"))
    await post(cluster, SERVICES, {**pod("llama", owner), "apiVersion": "v1", "kind": "Service"})
    await cluster.delete("llama")
    assert cluster.get("llama", SERVICES) is None  # no finalizers: gone at once
    dependent = cluster.get("llama-0", PODS)  # a running pod gets its grace period
    assert dependent is not None and dependent["metadata"]["deletionGracePeriodSeconds"] == 30
    assert cluster.get("unowned", PODS) is not None
    await cluster.server.confirm_termination(kmock.resource(PODS), NAMESPACE, "llama-0")
    assert cluster.get("llama-0", PODS) is None


async def test_a_dependent_of_a_missing_owner_is_collected(cluster: Cluster) -> None:
    ghost = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "g", "uid": "gone"}}
    await post(cluster, PODS, pod("orphan", ghost))
    assert cluster.get("orphan", PODS) is None


async def test_a_stale_resource_version_is_a_conflict(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    version = cluster.get("llama")["metadata"]["resourceVersion"]
    assert (await patch(cluster, CR, "llama", {"spec": {"replicas": 2}})).status == 200
    stale = await patch(
        cluster, CR, "llama", {"metadata": {"resourceVersion": version}, "spec": {"replicas": 3}}
    )
    assert stale.status == 409
    body = await stale.json()
    assert body["reason"] == "Conflict"
    assert "the object has been modified" in body["message"]
    assert cluster.get("llama")["spec"]["replicas"] == 2


async def test_creating_an_existing_name_is_already_exists(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    response = await cluster.server.post(cluster.path(CR), json=cache_replica("llama"))
    assert response.status == 409
    body = await response.json()
    assert (body["reason"], body["message"]) == (
        "AlreadyExists",
        'cachereplicas.cachepoint.dev "llama" already exists',
    )


async def test_the_operators_cache_replica_takes_its_children_with_it(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.wait(lambda: len(cluster.pods()) == 2, "2 pods")
    await cluster.delete("llama")
    await cluster.wait(
        lambda: cluster.get("llama") is None and not cluster.pods() and not cluster.list(SERVICES),
        "the CacheReplica and its children gone",
    )
