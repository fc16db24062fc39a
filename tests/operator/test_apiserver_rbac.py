"""The emulated API server authorizes the operator's requests by the chart's RBAC.

Unit tests of the authorizer on small manifests, then the server over HTTP: the
operator's token gets 403 for what is not granted, the tests' own requests (no token)
act as admin, and the real operator runs a whole CacheReplica lifecycle without a
single denied request under the rendered chart's ClusterRole.
"""

from __future__ import annotations

from typing import Any

import pytest

from cachepoint.bench.kube.apiserver import chart
from cachepoint.bench.kube.apiserver.rbac import Attributes, Authorizer, verb_of
from cachepoint.bench.kube.cluster import (
    CR,
    NAMESPACE,
    OPERATOR_API_TOKEN,
    PODS,
    SECRETS,
    Cluster,
    cache_replica,
)
from cachepoint.bench.kube.emulator import ApiServer

SA = "ops/bot"
USER = "system:serviceaccount:ops:bot"
AS_OPERATOR = {"Authorization": f"Bearer {OPERATOR_API_TOKEN}"}


def manifests(*rules: dict[str, Any], namespaced_in: str | None = None) -> list[dict[str, Any]]:
    """A role with `rules` bound to ops/bot: a Role+RoleBinding, or cluster-wide."""
    kind = "Role" if namespaced_in else "ClusterRole"
    meta = {"name": "r", **({"namespace": namespaced_in} if namespaced_in else {})}
    binding = {
        "kind": "RoleBinding" if namespaced_in else "ClusterRoleBinding",
        "metadata": meta,
        "roleRef": {"kind": kind, "name": "r", "apiGroup": "rbac.authorization.k8s.io"},
        "subjects": [{"kind": "ServiceAccount", "name": "bot", "namespace": "ops"}],
    }
    return [{"kind": kind, "metadata": meta, "rules": list(rules)}, binding]


def attrs_(verb: str, resource: str, group: str = "", **kw: Any) -> Attributes:
    return Attributes(user=USER, verb=verb, group=group, resource=resource, **kw)


@pytest.mark.parametrize(
    ("method", "named", "watch", "verb"),
    [
        ("GET", True, False, "get"),
        ("GET", False, False, "list"),
        ("GET", False, True, "watch"),
        ("GET", True, True, "watch"),
        ("POST", False, False, "create"),
        ("PATCH", True, False, "patch"),
        ("PUT", True, False, "update"),
        ("DELETE", True, False, "delete"),
        ("DELETE", False, False, "deletecollection"),
    ],
)
def test_http_requests_map_to_rbac_verbs(method: str, named: bool, watch: bool, verb: str) -> None:
    assert verb_of(method, named, watch) == verb


def test_a_subresource_needs_its_own_rule() -> None:
    rules = {"apiGroups": ["cachepoint.dev"], "resources": ["cachereplicas"], "verbs": ["patch"]}
    auth = Authorizer.from_manifests(manifests(rules), SA)
    assert auth.allows(attrs_("patch", "cachereplicas", "cachepoint.dev", namespace="a"))
    status = attrs_("patch", "cachereplicas", "cachepoint.dev", subresource="status")
    assert not auth.allows(status)
    assert not auth.allows(attrs_("patch", "cachereplicas", "other.dev"))
    assert not auth.allows(attrs_("get", "cachereplicas", "cachepoint.dev"))


def test_wildcards_and_resource_names() -> None:
    auth = Authorizer.from_manifests(
        manifests(
            {"apiGroups": ["*"], "resources": ["*/scale"], "verbs": ["*"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["s"]},
        ),
        SA,
    )
    assert auth.allows(attrs_("update", "deployments", "apps", subresource="scale"))
    assert not auth.allows(attrs_("update", "deployments", "apps"))
    assert auth.allows(attrs_("get", "secrets", name="s"))
    assert not auth.allows(attrs_("get", "secrets", name="t"))
    assert not auth.allows(attrs_("list", "secrets"))  # a collection has no name to match


def test_a_role_binding_grants_only_in_its_namespace() -> None:
    rule = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    auth = Authorizer.from_manifests(manifests(rule, namespaced_in="cachepoint"), SA)
    assert auth.allows(attrs_("get", "secrets", namespace="cachepoint", name="x"))
    assert not auth.allows(attrs_("get", "secrets", namespace="serving", name="x"))
    assert not auth.allows(attrs_("list", "secrets"))  # cluster-wide


def test_bindings_of_other_subjects_grant_nothing() -> None:
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]}
    auth = Authorizer.from_manifests(manifests(rule), "ops/someone-else")
    assert not auth.allows(attrs_("get", "pods", name="p"))


def test_the_chart_binds_its_operator_cluster_role() -> None:
    auth = Authorizer.from_manifests(chart.rendered_rbac(), chart.OPERATOR_SERVICE_ACCOUNT)
    assert auth.user == "system:serviceaccount:cachepoint:rel-cachepoint-operator"
    assert auth.allows(attrs_("watch", "cachereplicas", "cachepoint.dev"))
    assert not auth.allows(attrs_("delete", "cachereplicas", "cachepoint.dev", name="x"))


async def test_a_request_not_granted_gets_a_real_403(cluster: Cluster) -> None:
    path = cluster.path(CR, "llama")
    response = await cluster.server.delete(path, headers=AS_OPERATOR)
    assert response.status == 403
    body = await response.json()
    user = "system:serviceaccount:cachepoint:rel-cachepoint-operator"
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": (
            f'cachereplicas.cachepoint.dev "llama" is forbidden: User "{user}" cannot delete'
            ' resource "cachereplicas" in API group "cachepoint.dev" in the namespace "serving"'
        ),
        "reason": "Forbidden",
        "code": 403,
        "details": {"name": "llama", "kind": "cachereplicas", "group": "cachepoint.dev"},
    }
    assert cluster.server.denied[-1].code == 403


async def test_the_tests_own_requests_act_as_admin(cluster: Cluster) -> None:
    await cluster.create(cache_replica("llama"))
    await cluster.delete("llama")  # no token: allowed though the operator may not delete
    assert cluster.get("llama") is None


async def test_an_unknown_token_is_unauthorized(cluster: Cluster) -> None:
    response = await cluster.server.get(
        cluster.path(SECRETS), headers={"Authorization": "Bearer nope"}
    )
    assert response.status == 401


def pod_owned_by(owner: dict[str, Any], block: bool) -> dict[str, Any]:
    ref = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": block,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": NAMESPACE, "ownerReferences": [ref]},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }


async def owner_and_server(kmock: ApiServer, *rules: dict[str, Any]) -> dict[str, Any]:
    pods_verbs = ["create", "delete", "get", "list", "watch", "patch"]
    rules = ({"apiGroups": [""], "resources": ["pods"], "verbs": pods_verbs}, *rules)
    kmock.install_crd(next(c for c in chart.crds() if c["spec"]["names"]["kind"] == "CacheReplica"))
    kmock.resources[PODS] = kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"})
    kmock.enable_rbac(Authorizer.from_manifests(manifests(*rules), SA), "t")
    cluster = Cluster(kmock)
    await cluster.create(cache_replica("llama"))
    owner = cluster.get("llama")
    assert owner is not None
    return owner


@pytest.mark.parametrize("grant", [False, True])
async def test_block_owner_deletion_needs_update_on_the_owners_finalizers(
    kmock: ApiServer, grant: bool
) -> None:
    # The OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift).
    finalizers = {
        "apiGroups": ["cachepoint.dev"],
        "resources": ["cachereplicas/finalizers"],
        "verbs": ["update"],
    }
    owner = await owner_and_server(kmock, *([finalizers] if grant else []))
    response = await kmock.post(
        Cluster(kmock).path(PODS),
        json=pod_owned_by(owner, block=True),
        headers={"Authorization": "Bearer t"},
    )
    if grant:
        assert response.status == 201, await response.text()
    else:
        assert response.status == 403
        message = (await response.json())["message"]
        assert message == (
            'pods "p" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers'
            " to a resource you can't set finalizers on: , <nil>"
        )


async def test_an_owner_reference_without_blocking_needs_no_finalizers_grant(
    kmock: ApiServer,
) -> None:
    owner = await owner_and_server(kmock)
    response = await kmock.post(
        Cluster(kmock).path(PODS),
        json=pod_owned_by(owner, block=False),
        headers={"Authorization": "Bearer t"},
    )
    assert response.status == 201, await response.text()


async def test_the_operator_lives_a_whole_lifecycle_within_the_charts_rbac(
    cluster: Cluster, operator: Any, kubelet: None
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.wait(lambda: len(cluster.pods()) == 2, "2 pods")
    await cluster.patch("llama", {"spec": {"replicas": 3}}, sub="scale")
    await cluster.wait(lambda: len(cluster.pods()) == 3, "3 pods")
    await cluster.patch("llama", {"spec": {"image": "ghcr.io/cachepoint/replica:1.1"}})
    images = lambda: {p["spec"]["containers"][0]["image"] for p in cluster.pods().values()}  # noqa: E731
    await cluster.wait(lambda: images() == {"ghcr.io/cachepoint/replica:1.1"}, "rolled", 30)
    await cluster.delete("llama")
    await cluster.wait(lambda: cluster.get("llama") is None and not cluster.pods(), "all gone")
    writes = [r for r in cluster.server if cluster.server.from_operator(r) and r.data]
    assert len(writes) > 10  # the operator did write, with its own token
    assert [e.message for e in cluster.server.denied] == []
