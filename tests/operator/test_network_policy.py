"""Each CacheReplica's NetworkPolicy: the builder, the chart's settings for it, and the
real operator keeping it against the emulated API server (RBAC from the chart).

The members run in their CacheReplica's namespace, which may be any: the chart renders
no policy there (NAMESPACE, "serving", is none of the chart's), so the operator makes
one per CacheReplica.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import kmock
import kubernetes_validate
import pytest
from pydantic import ValidationError

from cachepoint.bench.kube.cluster import (
    CR,
    NAMESPACE,
    NETPOLS,
    PODS,
    Cluster,
    cache_replica,
    running_operator,
)
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.naming import common_labels
from cachepoint.operator.network import (
    build_replica_network_policy,
    network_policy_drift,
    network_policy_name,
)
from cachepoint.operator.pod import build_replica_pod
from cachepoint.operator.spec import parse_spec

from .test_cross_namespace import RELEASE, RELEASE_NAMESPACE, operator_env, render

K8S_VERSION = "1.31.0"
GATEWAY = {
    "app.kubernetes.io/name": "cachepoint",
    "app.kubernetes.io/instance": "rel",
    "app.kubernetes.io/component": "gateway",
}
OPERATOR = {**GATEWAY, "app.kubernetes.io/component": "operator"}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
# What the chart hands the operator (deployment-operator.yaml), as environment.
ENV = {
    "CACHEPOINT_OPERATOR_NETWORK_POLICY": "true",
    "CACHEPOINT_OPERATOR_RELEASE_NAMESPACE": "cachepoint",
    "CACHEPOINT_OPERATOR_GATEWAY_POD_LABELS": json.dumps(GATEWAY),
    "CACHEPOINT_OPERATOR_OPERATOR_POD_LABELS": json.dumps(OPERATOR),
    "CACHEPOINT_OPERATOR_METRICS_FROM": json.dumps([MONITORING]),
}
CONFIG = OperatorConfig.from_env(ENV)


def _from_release(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "cachepoint"}},
        "podSelector": {"matchLabels": labels},
    }


# ------------------------------------------------------------ the builder


def test_the_policy_lets_only_the_gateway_the_operator_and_scrapers_in() -> None:
    policy = build_replica_network_policy(replica="llama", namespace="team-a", config=CONFIG)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert policy["metadata"] == {
        "name": "llama-ingress",
        "namespace": "team-a",
        "labels": common_labels("llama"),
    }
    spec = policy["spec"]
    # This CacheReplica's members, by the labels the operator puts on them.
    assert spec["podSelector"] == {"matchLabels": common_labels("llama")}
    member = build_replica_pod(
        replica="llama",
        namespace="team-a",
        index=0,
        spec=parse_spec({"image": "r:1", "model": {"name": "m"}}),
        config=CONFIG,
    )
    assert spec["podSelector"]["matchLabels"].items() <= member["metadata"]["labels"].items()
    assert not (spec["podSelector"]["matchLabels"].items() <= common_labels("qwen").items())
    # Ingress only (members reach NATS and the rest as before), one rule: the http port,
    # by the name the member's container gives it (a new spec.port needs no new policy).
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert [p["name"] for p in member["spec"]["containers"][0]["ports"]] == ["http"]
    # From the release namespace's gateway and operator pods, and the scrapers (/metrics
    # is on the http port too); every peer narrowed, none that matches everything.
    assert rule["from"] == [_from_release(GATEWAY), _from_release(OPERATOR), MONITORING]


def test_without_scrapers_only_the_gateway_and_the_operator_get_in() -> None:
    config = CONFIG.model_copy(update={"metrics_from": []})
    policy = build_replica_network_policy(replica="llama", namespace="team-a", config=config)
    assert policy["spec"]["ingress"][0]["from"] == [_from_release(GATEWAY), _from_release(OPERATOR)]
    assert network_policy_name("llama") == "llama-ingress"


def test_drift_puts_the_whole_spec_back() -> None:
    desired = build_replica_network_policy(replica="llama", namespace="team-a", config=CONFIG)
    assert network_policy_drift(copy.deepcopy(desired), desired) == []
    # Rules add up, so anything added by hand only lets more in: none of it may stay.
    widened = copy.deepcopy(desired)
    widened["spec"]["ingress"].append({})
    widened["spec"]["podSelector"] = {"matchLabels": {"app": "other"}}
    assert network_policy_drift(widened, desired) == [
        {"op": "replace", "path": "/spec", "value": desired["spec"]}
    ]


def test_the_settings_come_as_json_and_must_name_every_peer() -> None:
    assert CONFIG.network_policy is True
    assert CONFIG.gateway_pod_labels == GATEWAY
    assert CONFIG.metrics_from == [MONITORING]
    # Off unless asked for: an operator run without the chart's settings makes none.
    assert OperatorConfig.from_env({}).network_policy is False
    # An empty podSelector would let every pod of the release namespace in: refused.
    for missing in (
        "CACHEPOINT_OPERATOR_RELEASE_NAMESPACE",
        "CACHEPOINT_OPERATOR_GATEWAY_POD_LABELS",
        "CACHEPOINT_OPERATOR_OPERATOR_POD_LABELS",
    ):
        env = {k: v for k, v in ENV.items() if k != missing}
        with pytest.raises(ValidationError, match="network_policy needs"):
            OperatorConfig.from_env(env)
    with pytest.raises(ValidationError):
        OperatorConfig.from_env({**ENV, "CACHEPOINT_OPERATOR_GATEWAY_POD_LABELS": "{not json"})


# ------------------------------------------------------------ what the chart hands over


def _pod_labels(docs: list[dict[str, Any]], component: str) -> dict[str, str]:
    name = f"{RELEASE}-cachepoint-{component}"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def _operator_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules of the operator's ClusterRole, or of its Roles (one per watched namespace)."""
    name = f"{RELEASE}-cachepoint-operator"
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    rules = [rule for d in roles if d["metadata"]["name"] == name for rule in d["rules"]]
    assert rules, "no operator role"
    return rules


def test_the_charts_settings_admit_the_charts_own_gateway_and_operator_pods() -> None:
    docs = render()
    config = OperatorConfig.from_env(operator_env(docs))
    assert config.network_policy
    policy = build_replica_network_policy(replica="llama", namespace="team-a", config=config)
    gateway, operator, *scrapers = policy["spec"]["ingress"][0]["from"]
    release = {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}}
    for peer, component in ((gateway, "gateway"), (operator, "operator")):
        assert peer["namespaceSelector"] == release
        selector = peer["podSelector"]["matchLabels"]
        assert selector, f"{component}: an empty selector admits every pod"
        assert selector.items() <= _pod_labels(docs, component).items(), component
    assert scrapers == [MONITORING]  # networkPolicy.metricsFrom's default
    # The chart itself renders no replicas policy, in no namespace: the operator's only.
    watched = render("operator.watchNamespaces={ml-a,ml-b}")
    names = [d["metadata"]["name"] for d in watched if d["kind"] == "NetworkPolicy"]
    assert f"{RELEASE}-cachepoint-replicas" not in names
    # ... and each watched namespace's Role grants what the operator calls for its own.
    grants = [r for r in _operator_rules(watched) if r["resources"] == ["networkpolicies"]]
    assert [(r["apiGroups"], r["verbs"]) for r in grants] == [
        (["networking.k8s.io"], ["get", "create", "patch"])
    ] * 2
    closed = OperatorConfig.from_env(operator_env(render("networkPolicy.metricsFrom=null")))
    assert closed.network_policy and closed.metrics_from == []


def test_network_policies_off_turns_the_operators_off_and_its_rbac_with_them() -> None:
    docs = render("networkPolicy.enabled=false")
    env = operator_env(docs)
    assert not any("POD_LABELS" in name or "METRICS_FROM" in name for name in env)
    assert OperatorConfig.from_env(env).network_policy is False
    assert not [r for r in _operator_rules(docs) if "networkpolicies" in r["resources"]]


# ------------------------------------------------------------ the operator, against the API


ENV_FIELDS = (
    "network_policy",
    "release_namespace",
    "gateway_pod_labels",
    "operator_pod_labels",
    "metrics_from",
)


@pytest.fixture
def keeps_policies(monkeypatch: pytest.MonkeyPatch) -> OperatorConfig:
    """The operator with the chart's network policy settings (conftest's have none)."""
    from cachepoint.operator import handlers

    update = {k: getattr(CONFIG, k) for k in ENV_FIELDS}
    config = handlers.CONFIG.model_copy(update=update)
    monkeypatch.setattr(handlers, "CONFIG", config)
    return config


def _policy(cluster: Cluster, replica: str = "llama") -> dict[str, Any] | None:
    return cluster.get(network_policy_name(replica), NETPOLS)


def _requests(cluster: Cluster, resource: str, action: Any) -> list[Any]:
    wanted = kmock.resource(resource)
    return [r for r in cluster.server if r.resource == wanted and r.action == action]


async def _write_policy(cluster: Cluster, method: str, body: dict[str, Any] | None = None) -> None:
    """A hand edit (kubectl edit / delete), as cluster-admin."""
    path = cluster.path(NETPOLS, network_policy_name("llama"))
    headers = {"Content-Type": "application/merge-patch+json"}
    if method == "patch":
        response = await cluster.server.patch(path, data=json.dumps(body), headers=headers)
    else:
        response = await cluster.server.delete(path)
    assert response.status == 200, await response.text()


async def test_a_replica_in_any_namespace_gets_its_policy_kept_and_collected(
    cluster: Cluster, keeps_policies: OperatorConfig
) -> None:
    async with running_operator():
        await cluster.create(cache_replica("llama", replicas=1))
        policy = await cluster.wait(lambda: _policy(cluster), "the NetworkPolicy")
        cr = cluster.get("llama")
        assert cr is not None
        assert policy["metadata"]["namespace"] == NAMESPACE
        (owner,) = policy["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == ("CacheReplica", cr["metadata"]["uid"])
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
        want = build_replica_network_policy(
            replica="llama", namespace=NAMESPACE, config=keeps_policies
        )
        assert policy["spec"] == want["spec"]
        pod = await cluster.wait(lambda: cluster.pods().get("llama-0"), "a member")
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        # Made by the operator, under the chart's RBAC, before any member existed.
        (create,) = _requests(cluster, NETPOLS, kmock.action.CREATE)
        assert cluster.server.from_operator(create)
        requests = list(cluster.server)
        first_pod = next(
            i
            for i, r in enumerate(requests)
            if r.resource == kmock.resource(PODS) and r.action == kmock.action.CREATE
        )
        assert requests.index(create) < first_pod

        # Widened by hand (every source let in, every pod selected): put back.
        await _write_policy(
            cluster, "patch", {"spec": {"ingress": [{}], "podSelector": {"matchLabels": None}}}
        )
        widened = _policy(cluster) or {}
        assert widened["spec"]["podSelector"] == {} or widened["spec"] == want["spec"]
        await cluster.wait(
            lambda: (_policy(cluster) or {}).get("spec") == want["spec"], "the policy put back"
        )
        # Deleted by hand: made again, before the next member heal would run unguarded.
        await _write_policy(cluster, "delete")
        again = await cluster.wait(lambda: _policy(cluster), "the policy made again")
        assert again["metadata"]["uid"] != policy["metadata"]["uid"]
        assert again["spec"] == want["spec"]

        await cluster.delete("llama")
        await cluster.wait(lambda: cluster.get("llama") is None, "the CacheReplica gone")
        # The garbage collector's doing (owner reference): the operator deletes none.
        await cluster.wait(lambda: _policy(cluster) is None, "the policy collected")
        assert [
            r
            for r in _requests(cluster, NETPOLS, kmock.action.DELETE)
            if cluster.server.from_operator(r)
        ] == []


async def test_no_member_is_made_while_its_policy_is_refused(
    cluster: Cluster, keeps_policies: OperatorConfig
) -> None:
    from cachepoint.bench.kube.apiserver import chart
    from cachepoint.bench.kube.apiserver.rbac import Authorizer
    from cachepoint.bench.kube.cluster import OPERATOR_API_TOKEN

    # RBAC that may read policies but not create them (a chart older than the operator).
    docs = copy.deepcopy(list(chart.rendered_rbac()))
    for doc in docs:
        for rule in doc.get("rules") or []:
            if "networkpolicies" in rule.get("resources", []):
                rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    cluster.server.enable_rbac(
        Authorizer.from_manifests(docs, chart.OPERATOR_SERVICE_ACCOUNT), OPERATOR_API_TOKEN
    )

    async with running_operator():
        await cluster.create(cache_replica("llama", replicas=1))

        def degraded() -> dict[str, Any] | None:
            conditions = (cluster.get("llama") or {}).get("status", {}).get("conditions") or []
            found = next((c for c in conditions if c["type"] == "Degraded"), None)
            return found if found and found.get("reason") == "CreateFailed" else None

        condition = await cluster.wait(degraded, "Degraded CreateFailed")
        assert condition["message"].startswith("create NetworkPolicy llama-ingress: 403 ")
        await asyncio.sleep(1.0)  # five timer ticks: none heals a member in unguarded
        assert cluster.pods() == {}
        assert degraded() is not None


async def test_with_network_policies_off_the_operator_never_calls_for_them(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=1))
    await cluster.wait(lambda: cluster.pods().get("llama-0"), "a member")
    await asyncio.sleep(1.0)  # a few timer ticks
    wanted = kmock.resource(NETPOLS)
    assert [r for r in cluster.server if r.resource == wanted] == []
    assert _requests(cluster, CR, kmock.action.CREATE)  # the walk did see requests
