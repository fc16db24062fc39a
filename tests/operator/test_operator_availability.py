"""The real operator (kopf) against the emulated API: members that fail are replaced and
reported, the PodDisruptionBudget follows the CacheReplica, a refused create shows in
status, and a settled CacheReplica costs no LIST and no status write per timer tick."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kmock
import pytest

from cachepoint.bench.kube.cluster import (
    CR,
    EVENTS,
    PDBS,
    PODS,
    Cluster,
    StatsServer,
    cache_replica,
)


def _condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = (cr or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _ready(cluster: Cluster, name: str) -> bool:
    return _condition(cluster.get(name), "Ready").get("status") == "True"


async def test_a_failed_member_is_replaced_and_reported(
    cluster: Cluster, operator: Any, kubelet: None, stats_server: StatsServer
) -> None:
    await cluster.create(cache_replica("llama", replicas=2, port=stats_server.port))
    await cluster.wait(lambda: _ready(cluster, "llama"), "Ready")
    evicted = cluster.pods()["llama-1"]["metadata"]["uid"]
    status = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
        "conditions": [{"type": "Ready", "status": "False"}],
    }
    # What the kubelet writes when it evicts a pod: the pod stays, Failed, until deleted.
    response = await cluster.server.patch(
        cluster.path(PODS, "llama-1", "status"), json={"status": status}
    )
    assert response.status == 200, await response.text()

    degraded = await cluster.wait(
        lambda: (
            _condition(cluster.get("llama"), "Degraded").get("reason") == "MemberFailed"
            and _condition(cluster.get("llama"), "Degraded")
        ),
        "Degraded MemberFailed",
    )
    assert degraded["status"] == "True"
    assert degraded["message"] == "llama-1 Failed: Evicted: The node was low on resource: memory."
    await cluster.wait(
        lambda: [e for e in cluster.list(EVENTS) if e.get("reason") == "MemberFailed"],
        "a MemberFailed event",
    )
    # Replaced under the same name, and healthy again.
    await cluster.wait(
        lambda: (
            cluster.pods().get("llama-1", {}).get("metadata", {}).get("uid") not in (None, evicted)
        ),
        "a new llama-1",
    )
    await cluster.wait(
        lambda: (
            _ready(cluster, "llama")
            and _condition(cluster.get("llama"), "Degraded").get("status") == "False"
        ),
        "Ready and no longer Degraded",
    )


async def test_the_disruption_budget_follows_the_replica(cluster: Cluster, operator: Any) -> None:
    await cluster.create(cache_replica("llama", replicas=3))
    pdb = await cluster.wait(lambda: cluster.get("llama", PDBS), "the PodDisruptionBudget")
    cr = cluster.get("llama")
    assert cr is not None
    (owner,) = pdb["metadata"]["ownerReferences"]
    assert (owner["uid"], owner["controller"]) == (cr["metadata"]["uid"], True)
    assert pdb["spec"]["maxUnavailable"] == 1
    labels = pdb["spec"]["selector"]["matchLabels"]
    pod = await cluster.wait(lambda: cluster.pods().get("llama-0"), "a member")
    assert labels.items() <= pod["metadata"]["labels"].items()  # it selects the members

    await cluster.patch("llama", {"spec": {"rollout": {"maxUnavailable": 2}}})
    await cluster.wait(
        lambda: (cluster.get("llama", PDBS) or {}).get("spec", {}).get("maxUnavailable") == 2,
        "maxUnavailable 2 on the budget",
    )
    await cluster.delete("llama")
    await cluster.wait(lambda: cluster.get("llama") is None, "the CacheReplica gone")
    assert cluster.get("llama", PDBS) is None


async def test_a_delete_does_not_wait_a_minute_for_a_status_tick_in_flight(
    cluster: Cluster, stats_server: StatsServer, kubelet: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachepoint.bench.kube.cluster import running_operator
    from cachepoint.operator import handlers

    # A replica that takes 4 s to answer /v1/stats (within the poll's timeout): the
    # timer's tick is still in flight when the deletion handler is done.
    monkeypatch.setattr(handlers, "CONFIG", handlers.CONFIG.model_copy(update={"stats_timeout": 8}))
    async with running_operator():
        await cluster.create(cache_replica("llama", replicas=1, port=stats_server.port))
        await cluster.wait(lambda: _ready(cluster, "llama"), "Ready")
        stats_server.delay_s = 4.0
        calls = stats_server.stats_calls
        await cluster.wait(lambda: stats_server.stats_calls > calls, "a stats call in flight")
        await cluster.delete("llama")
        # kopf re-checks an exiting timer every `cancellation_polling` seconds: 60 by
        # default, which held the finalizer (and `helm uninstall`) for a minute.
        await cluster.wait(lambda: cluster.get("llama") is None, "the CacheReplica gone", 12)


async def test_a_refused_create_shows_the_apis_message(cluster: Cluster) -> None:
    from cachepoint.bench.kube.apiserver import chart
    from cachepoint.bench.kube.apiserver.rbac import Authorizer
    from cachepoint.bench.kube.cluster import OPERATOR_API_TOKEN, running_operator

    # An RBAC that lets the operator read budgets but not create them (a chart older
    # than the operator, or a cluster policy): the API's 403 must reach the user.
    docs = copy.deepcopy(list(chart.rendered_rbac()))
    for doc in docs:
        for rule in doc.get("rules") or []:
            if "poddisruptionbudgets" in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    authorizer = Authorizer.from_manifests(docs, chart.OPERATOR_SERVICE_ACCOUNT)
    cluster.server.enable_rbac(authorizer, OPERATOR_API_TOKEN)

    async with running_operator():
        await cluster.create(cache_replica("llama", replicas=1))
        degraded = await cluster.wait(
            lambda: (
                _condition(cluster.get("llama"), "Degraded").get("reason") == "CreateFailed"
                and _condition(cluster.get("llama"), "Degraded")
            ),
            "Degraded CreateFailed",
        )
        assert degraded["status"] == "True"
        assert degraded["message"].startswith("create PodDisruptionBudget llama: 403 ")
        assert "forbidden" in degraded["message"]
        assert (cluster.get("llama") or {})["status"]["phase"] == "Degraded"
        # The timer keeps it: status is rebuilt every tick, the refusal is not forgotten.
        await asyncio.sleep(1.0)
        assert _condition(cluster.get("llama"), "Degraded")["reason"] == "CreateFailed"
        events = [e for e in cluster.list(EVENTS) if e.get("reason") == "CreateFailed"]
        assert events and "forbidden" in events[0]["message"]


def _requests_since(cluster: Cluster, start: int) -> list[Any]:
    return list(cluster.server)[start:]


async def test_a_settled_replica_costs_no_list_and_no_status_write_per_tick(
    cluster: Cluster, operator: Any, kubelet: None, stats_server: StatsServer
) -> None:
    for name in ("llama", "qwen"):
        await cluster.create(cache_replica(name, replicas=2, port=stats_server.port))
    for name in ("llama", "qwen"):
        await cluster.wait(
            lambda name=name: (
                _ready(cluster, name)
                and (cluster.get(name) or {}).get("status", {}).get("blocks", {}).get("total")
                == 2000
            ),
            f"{name} ready with stats",
        )
    await asyncio.sleep(0.5)  # the last writes and their watch events settle
    start = len(list(cluster.server))
    pods, crs, secrets = kmock.resource(PODS), kmock.resource(CR), kmock.resource("v1/secrets")

    def ticks() -> list[Any]:
        # Each timer tick reads its credentials Secret by name, so these count ticks.
        return [
            r
            for r in _requests_since(cluster, start)
            if r.resource == secrets and r.action == kmock.action.FETCH
        ]

    # NOTE: counted, not timed: on a loaded CI machine the 0.2 s timer falls behind, and
    # what matters is how many ticks cost nothing, not how fast they came.
    await cluster.wait(lambda: len(ticks()) >= 12, "six timer ticks for each of the two")
    window = _requests_since(cluster, start)
    lists = [r for r in window if r.resource == pods and r.action == kmock.action.LIST]
    writes = [
        r
        for r in window
        if r.resource == crs and r.action == kmock.action.UPDATE and r.subresource == "status"
    ]
    assert lists == []
    assert writes == []
    # Something that changes is still written: a new hit rate reaches status.
    stats_server.stats["hit_tokens"] = 1000
    await cluster.wait(
        lambda: (cluster.get("llama") or {}).get("status", {}).get("hitRate") == 0.25,
        "the new hit rate",
    )


async def test_a_roll_never_has_more_than_max_unavailable_members_down(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    await cluster.create(cache_replica("llama", replicas=4, rollout={"maxUnavailable": 2}))
    await cluster.wait(lambda: _ready(cluster, "llama"), "Ready")
    new_image = "ghcr.io/cachepoint/replica:1.1"
    most_down, done = 0, asyncio.Event()

    def down() -> int:
        pods = cluster.pods()
        return sum(
            not (
                (pod := pods.get(f"llama-{i}"))
                and not pod["metadata"].get("deletionTimestamp")
                and any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in pod.get("status", {}).get("conditions") or []
                )
            )
            for i in range(4)
        )

    async def watch() -> None:
        nonlocal most_down
        while not done.is_set():
            most_down = max(most_down, down())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    await cluster.patch("llama", {"spec": {"image": new_image}})
    await cluster.wait(
        lambda: (
            [p["spec"]["containers"][0]["image"] for p in cluster.pods().values()]
            == [new_image] * 4
            and _ready(cluster, "llama")
        ),
        "all four members on the new image and ready",
        timeout=30,
    )
    done.set()
    await watcher
    assert 1 <= most_down <= 2
