"""The real operator (kopf) against a Kubernetes API mock (kmock): the CacheReplica life."""

from __future__ import annotations

import asyncio
from typing import Any

import kmock

from cachepoint.bench.kube.cluster import (
    EVENTS,
    NAMESPACE,
    PDBS,
    PODS,
    SERVICES,
    Cluster,
    StatsServer,
    cache_replica,
    running_operator,
)


def _image(pod: dict[str, Any]) -> str:
    return pod["spec"]["containers"][0]["image"]


def _condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = (cr or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


async def test_apply_creates_gpu_members_and_service(cluster: Cluster, operator: Any) -> None:
    await cluster.create(cache_replica("llama", replicas=2, tensorParallelSize=2, gpusPerPod=2))
    pods = await cluster.wait(lambda: len(cluster.pods()) == 2 and cluster.pods(), "2 pods")
    service = await cluster.wait(lambda: cluster.get("llama", SERVICES), "the Service")
    cr = cluster.get("llama")
    assert cr is not None
    assert "cachepoint.dev/finalizer" in cr["metadata"]["finalizers"]
    assert sorted(pods) == ["llama-0", "llama-1"]
    for child in [*pods.values(), service]:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == cr["metadata"]["uid"]
        assert (owner["kind"], owner["controller"]) == ("CacheReplica", True)
    container = pods["llama-0"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CACHEPOINT_REPLICA_TENSOR_PARALLEL_SIZE"] == "2"
    assert env["CACHEPOINT_REPLICA_DEVICE"] == "cuda"
    assert env["CACHEPOINT_NATS_URL"] == "nats://cachepoint-nats:4222"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://cachepoint-otel-collector:4317"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"cachepoint.dev/replica": "llama"}
    # Handled once: the generation it acted on is recorded.
    await cluster.wait(
        lambda: (cluster.get("llama") or {}).get("status", {}).get("observedGeneration") == 1,
        "observedGeneration 1",
    )


def _child_writes(cluster: Cluster) -> list[Any]:
    children = (kmock.resource(PODS), kmock.resource(SERVICES), kmock.resource(PDBS))
    writes = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
    return [
        r
        for r in cluster.server
        if r.resource in children and r.action in writes and not r.subresource
    ]


async def test_a_restarted_operator_changes_nothing(cluster: Cluster, kubelet: None) -> None:
    async with running_operator():
        await cluster.create(cache_replica("llama", replicas=2))
        await cluster.wait(
            lambda: _condition(cluster.get("llama"), "Ready").get("status") == "True", "Ready"
        )
    before = len(_child_writes(cluster))
    assert before >= 4  # two pods, the Service and the budget were written the first time
    # The resume handler runs the same reconcile on the settled object: a no-op.
    async with running_operator() as runner:
        await asyncio.sleep(1.0)  # resume, then five timer ticks and retry delays
    assert "Resuming is processed: 1 succeeded; 0 failed." in runner.output
    assert len(_child_writes(cluster)) == before


async def test_scale_subresource_adds_and_removes_members(cluster: Cluster, operator: Any) -> None:
    await cluster.create(cache_replica("llama", replicas=1, gpusPerPod=1))
    await cluster.wait(lambda: list(cluster.pods()) == ["llama-0"], "1 pod")

    await cluster.patch("llama", {"spec": {"replicas": 3}}, sub="scale")  # kubectl scale
    await cluster.wait(lambda: sorted(cluster.pods()) == ["llama-0", "llama-1", "llama-2"], "3")
    first = cluster.pods()["llama-0"]["metadata"]["uid"]

    await cluster.patch("llama", {"spec": {"replicas": 1}}, sub="scale")
    await cluster.wait(lambda: list(cluster.pods()) == ["llama-0"], "back to 1 pod")
    # Scaling never touches the members that stay.
    assert cluster.pods()["llama-0"]["metadata"]["uid"] == first


async def test_image_update_rolls_members_one_at_a_time(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.wait(
        lambda: (cluster.get("llama") or {}).get("status", {}).get("readyReplicas") == 2,
        "2 ready members",
    )
    await cluster.patch("llama", {"spec": {"image": "ghcr.io/cachepoint/replica:1.1"}})
    await cluster.wait(
        lambda: (
            [_image(p) for p in cluster.pods().values()] == ["ghcr.io/cachepoint/replica:1.1"] * 2
        ),
        "both members on the new image",
    )
    # The pod writes, in order: member 0 goes and comes back before member 1 goes.
    writes = [
        (request.action, request.name or request.data["metadata"]["name"])
        for request in cluster.server
        if request.resource == kmock.resource(PODS)
        and request.action in (kmock.action.CREATE, kmock.action.DELETE)
    ]
    # NOTE: the timer and the update handler may both try to bring llama-0 back; the
    # second CREATE gets 409 AlreadyExists, so a repeated request is one write.
    writes = [w for i, w in enumerate(writes) if i == 0 or w != writes[i - 1]]
    rolled = writes[writes.index((kmock.action.DELETE, "llama-0")) :]
    assert rolled == [
        (kmock.action.DELETE, "llama-0"),
        (kmock.action.CREATE, "llama-0"),
        (kmock.action.DELETE, "llama-1"),
        (kmock.action.CREATE, "llama-1"),
    ]
    await cluster.wait(
        lambda: _condition(cluster.get("llama"), "Ready").get("status") == "True", "Ready"
    )


async def test_status_follows_member_stats_and_sees_restarts(
    cluster: Cluster, operator: Any, kubelet: None, stats_server: StatsServer
) -> None:
    # The kubelet gives every pod 127.0.0.1; the spec's port is the stub replica's.
    await cluster.create(cache_replica("llama", replicas=2, port=stats_server.port))

    def status() -> dict[str, Any]:
        return (cluster.get("llama") or {}).get("status", {})

    await cluster.wait(lambda: status().get("blocks", {}).get("total") == 2000, "blocks")
    current = status()
    assert current["blocks"] == {"total": 2000, "active": 200, "cached": 600, "retained": 100}
    assert current["hitRate"] == 0.75
    assert current["tokens"] == {"query": 8000, "hit": 6000}
    assert [m["epoch"] for m in current["members"]] == [1, 1]
    assert current["phase"] == "Running"
    assert _condition(cluster.get("llama"), "Ready")["status"] == "True"

    stats_server.stats["hit_tokens"] = 1000
    await cluster.wait(lambda: status().get("hitRate") == 0.25, "hit rate to follow")

    stats_server.stats["epoch"] = 2  # both stub "processes" restarted
    await cluster.wait(
        lambda: [m.get("restarts") for m in status().get("members", [])] == [1, 1],
        "restarts counted",
    )
    assert [m["epoch"] for m in status()["members"]] == [2, 2]
    await cluster.wait(
        lambda: [e for e in cluster.list(EVENTS) if e.get("reason") == "MemberRestarted"],
        "MemberRestarted events",
    )
    await asyncio.sleep(0.5)  # a few more polls on the same epoch count nothing more
    assert [m["restarts"] for m in status()["members"]] == [1, 1]


async def test_delete_removes_children_then_releases_the_finalizer(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.wait(lambda: len(cluster.pods()) == 2 and cluster.get("llama", SERVICES), "up")
    await cluster.delete("llama")
    await cluster.wait(lambda: cluster.get("llama") is None, "the CacheReplica gone")
    assert cluster.pods() == {}
    assert cluster.get("llama", SERVICES) is None


async def test_bad_spec_is_degraded_once_without_crash_loop(
    cluster: Cluster, operator: Any
) -> None:
    # NOTE: one the CRD's own rules cannot see (they reject TP above gpusPerPod at the
    # API): the heads come from the checkpoint, only the operator checks them.
    model = {"name": "llama-3-8b", "numAttentionHeads": 3}
    await cluster.create(cache_replica("llama", tensorParallelSize=2, gpusPerPod=2, model=model))
    degraded = await cluster.wait(
        lambda: (
            _condition(cluster.get("llama"), "Degraded").get("status") == "True"
            and _condition(cluster.get("llama"), "Degraded")
        ),
        "Degraded",
    )
    assert degraded["reason"] == "InvalidSpec"
    assert "does not divide model.numAttentionHeads 3" in degraded["message"]
    assert (cluster.get("llama") or {})["status"]["phase"] == "Degraded"
    await asyncio.sleep(1.0)  # five retry delays: a TemporaryError would have retried
    assert cluster.pods() == {}
    rejected = [e for e in cluster.list(EVENTS) if e.get("reason") == "InvalidSpec"]
    assert len(rejected) == 1, cluster.list(EVENTS)  # rejected once, never retried
    assert rejected[0]["type"] == "Warning"

    # Fixing the spec is a new change: it is handled, and the condition clears.
    await cluster.patch("llama", {"spec": {"model": {"numAttentionHeads": 4}}})
    await cluster.wait(lambda: len(cluster.pods()) == 1, "the member once the spec is fixed")
    await cluster.wait(
        lambda: _condition(cluster.get("llama"), "Degraded").get("status") == "False",
        "Degraded cleared",
    )


async def test_a_service_that_is_not_ours_is_left_alone(cluster: Cluster, operator: Any) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "other"}, "ports": [{"port": 1234}]},
    }
    response = await cluster.server.post(cluster.path(SERVICES), json=foreign)
    assert response.status in (200, 201)
    await cluster.create(cache_replica("llama"))
    await cluster.wait(
        lambda: [e for e in cluster.list(EVENTS) if e.get("reason") == "NameConflict"],
        "a NameConflict event",
    )
    service = cluster.get("llama", SERVICES)
    assert service is not None
    assert service["spec"] == foreign["spec"]
    assert "ownerReferences" not in service["metadata"]
