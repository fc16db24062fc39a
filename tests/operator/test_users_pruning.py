"""NATS users of deleted CacheReplicas go for sure, whatever wrote them back.

The delete handler drops a CacheReplica's users, but a timer tick that began before the
deletion (or a finalizer removed by hand) can leave them in the users Secret: the
operator's pruner lists the CacheReplicas that exist and drops every other record key.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from cachepoint.bench.kube.cluster import NAMESPACE, USERS_SECRET, Cluster, cache_replica
from cachepoint.operator import credentials, handlers, kube
from cachepoint.operator.members import Plan
from cachepoint.operator.nats_auth import build_users_data, live_record_keys, prune_record

from .test_credentials import member_users as users_in_conf
from .test_users_conflicts import CONFIG, FakeApi, record

PASSWORD = "p" * 24


async def write_record(cluster: Cluster, entries: dict[str, dict[str, str]]) -> None:
    """What a late timer tick does: write the users Secret from a record it computed."""
    namespace, name = USERS_SECRET
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    headers = {"Content-Type": "application/merge-patch+json"}
    body = json.dumps({"data": build_users_data(entries)})
    response = await cluster.server.patch(path, data=body, headers=headers)
    assert response.status == 200, await response.text()


def stored_record(cluster: Cluster) -> dict[str, Any]:
    return dict(json.loads((cluster.secret(*USERS_SECRET) or {}).get("members.json", "{}")))


async def test_the_last_cache_replicas_users_written_back_after_delete_are_pruned(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=1))
    await cluster.wait(lambda: set(users_in_conf(cluster)) == {"serving_llama-0"}, "1 user")
    stale = stored_record(cluster)
    await cluster.delete("llama")
    await cluster.wait(lambda: cluster.get("llama") is None, "llama gone")
    await cluster.wait(lambda: users_in_conf(cluster) == {}, "the delete handler's removal")

    # A tick that read the object before the deletion writes its users back afterwards.
    await write_record(cluster, stale)
    assert set(users_in_conf(cluster)) == {"serving_llama-0"}
    # No CacheReplica is left, so no per-object timer runs: the pruner still removes them.
    await cluster.wait(lambda: users_in_conf(cluster) == {}, "the stale users pruned")
    assert stored_record(cluster) == {}


async def test_users_of_a_cache_replica_being_deleted_go_and_the_others_stay(
    cluster: Cluster, operator: Any
) -> None:
    held = cache_replica("llama", replicas=1)
    held["metadata"]["finalizers"] = ["example.com/hold"]  # keeps it in deletion
    await cluster.create(held)
    await cluster.create(cache_replica("qwen", replicas=1))
    both = {"serving_llama-0", "serving_qwen-0"}
    await cluster.wait(lambda: set(users_in_conf(cluster)) == both, "users of both")
    stale = stored_record(cluster)

    await cluster.delete("llama")
    await cluster.wait(
        lambda: set(users_in_conf(cluster)) == {"serving_qwen-0"}, "llama's users dropped"
    )
    cr = cluster.get("llama")
    assert cr is not None and cr["metadata"].get("deletionTimestamp")  # still there
    # Its users come back (a late tick; a record written by an older operator) ...
    await write_record(cluster, stale)
    # ... and go again, while qwen's stay and keep their password.
    await cluster.wait(
        lambda: set(users_in_conf(cluster)) == {"serving_qwen-0"}, "the deleting one pruned"
    )
    assert users_in_conf(cluster)["serving_qwen-0"] == stale["serving/qwen"]["serving_qwen-0"]
    await cluster.patch("llama", {"metadata": {"finalizers": None}})


def test_prune_record_keeps_only_existing_keys() -> None:
    entries = {"a/x": {"a_x-0": PASSWORD}, "a/y": {"a_y-0": PASSWORD}, "b/x": {"b_x-0": "q"}}
    assert prune_record(entries, {"a/x", "b/x", "c/z"}) == {
        "a/x": {"a_x-0": PASSWORD},
        "b/x": {"b_x-0": "q"},
    }
    assert prune_record(entries, set()) == {}
    assert prune_record({}, {"a/x"}) == {}
    objects = [
        {"metadata": {"namespace": "a", "name": "x"}},
        {"metadata": {"namespace": "a", "name": "y", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ]
    assert live_record_keys(objects) == {"a/x"}


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    fake = FakeApi()
    for name in ("get_secret", "create_secret", "patch_secret"):
        monkeypatch.setattr(kube, name, getattr(fake, name))
    return fake


@pytest.fixture
def crs(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """CacheReplicas per namespace, as list_cache_replicas answers; a missing key is a 403."""
    existing: dict[str, list[dict[str, Any]]] = {}

    def list_cache_replicas(namespace: str) -> list[dict[str, Any]]:
        if namespace not in existing:
            raise ApiException(status=403, reason="Forbidden")
        return list(existing[namespace])

    monkeypatch.setattr(kube, "list_cache_replicas", list_cache_replicas)
    return existing


def cr(namespace: str, name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}}


def test_prune_drops_gone_and_unlistable_namespaces_only(
    api: FakeApi, crs: dict[str, list[dict[str, Any]]]
) -> None:
    for ns, name in (("ns", "a"), ("ns", "b"), ("old", "c")):
        credentials.sync_nats_users(CONFIG, ns, name, {f"{name}-0": PASSWORD})
    crs["ns"] = [cr("ns", "a")]  # b is gone; "old" is a namespace it may no longer list
    assert credentials.prune_nats_users(CONFIG)
    assert set(record(api)) == {"ns/a"}
    conf = base64.b64decode(api.objects[("rel", "users")]["data"]["users.conf"]).decode()
    assert '"ns_a-0"' in conf and "ns_b-0" not in conf
    version = api.version
    assert not credentials.prune_nats_users(CONFIG)
    assert api.version == version  # nothing written when nothing is stale


def test_a_cache_replica_added_during_the_prune_keeps_its_users(
    api: FakeApi, crs: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials.sync_nats_users(CONFIG, "ns", "a", {"a-0": PASSWORD})
    credentials.sync_nats_users(CONFIG, "ns", "gone", {"gone-0": PASSWORD})
    crs["ns"] = [cr("ns", "a")]
    listed = kube.list_cache_replicas
    raced: list[bool] = []

    def list_while_new_one_is_created(namespace: str) -> list[dict[str, Any]]:
        result = listed(namespace)
        if not raced:
            # After our list, "new" is created and its handler adds its users.
            raced.append(True)
            crs["ns"].append(cr("ns", "new"))
            credentials.sync_nats_users(CONFIG, "ns", "new", {"new-0": PASSWORD})
        return result

    monkeypatch.setattr(kube, "list_cache_replicas", list_while_new_one_is_created)
    assert credentials.prune_nats_users(CONFIG)
    assert set(record(api)) == {"ns/a", "ns/new"}  # the conditional write saw the race


async def test_a_timer_tick_does_not_write_back_users_of_an_object_deleted_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uid = "uid-1"
    deleting = {"metadata": {"name": "llama", "namespace": NAMESPACE, "uid": uid}}
    writes: list[Any] = []
    delete_meanwhile = [True]

    def ensure_credentials(*args: Any) -> dict[str, str]:
        if delete_meanwhile.pop():
            # While this tick made sure of the credentials, the object was deleted.
            deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {"llama-0": PASSWORD}

    monkeypatch.setattr(credentials, "ensure_credentials", ensure_credentials)
    monkeypatch.setattr(kube, "get_cache_replica", lambda ns, name: deleting)
    monkeypatch.setattr(credentials, "sync_nats_users", lambda *a: writes.append(a))

    def converge_members(*args: Any, **kwargs: Any) -> Plan:
        writes.append(args)
        return Plan()

    monkeypatch.setattr(handlers.children, "converge_members", converge_members)
    spec = cache_replica("llama", replicas=1)["spec"]
    await handlers.refresh_status(
        body=kopf.Body({**deleting, "spec": spec}),
        name="llama",
        namespace=NAMESPACE,
        uid=uid,
        spec=spec,
        status={"observedGeneration": 1},
        meta={"generation": 1},
        patch=kopf.Patch(),
        logger=logging.getLogger("test"),
        memo=kopf.Memo(),
        member_pods={},  # the pod index: no members yet
    )
    assert writes == []  # neither its users nor its pods come back

    # A live object is written as before.
    del deleting["metadata"]["deletionTimestamp"]
    delete_meanwhile.append(False)
    await handlers.refresh_status(
        body=kopf.Body({**deleting, "spec": spec}),
        name="llama",
        namespace=NAMESPACE,
        uid=uid,
        spec=spec,
        status={"observedGeneration": 1},
        meta={"generation": 1},
        patch=kopf.Patch(),
        logger=logging.getLogger("test"),
        memo=kopf.Memo(),
        member_pods={},  # the pod index: no members yet
    )
    assert len(writes) == 2 and writes[0][3] == {"llama-0": PASSWORD}
