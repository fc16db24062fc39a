"""Operator HA: two pods by default, coordinated by kopf peering."""

from __future__ import annotations

from typing import Any

import yaml
from kopf._cogs.structs.references import CLUSTER_PEERINGS_K, NAMESPACED_PEERINGS_K

from cachepoint.operator.main import parse_args

from .conftest import CHART, RELEASE, render
from .test_chart import objects, one

FULLNAME = f"{RELEASE}-cachepoint"
PEERING = f"{FULLNAME}-operator"
PEERING_VERBS = {"get", "list", "watch", "patch"}


def grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    deployment = one(docs, "Deployment", PEERING)
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_the_chart_ships_kopfs_peering_crds() -> None:
    crds = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all((CHART / "crds" / "kopfpeerings.yaml").read_text())
    }
    assert set(crds) == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    # The group, version and plurals the installed kopf looks for.
    for scope, selector in (
        ("Cluster", CLUSTER_PEERINGS_K),
        ("Namespaced", NAMESPACED_PEERINGS_K),
    ):
        crd = crds[f"{selector.any_name}.{selector.group}"]["spec"]
        assert crd["scope"] == scope
        assert crd["group"] == selector.group
        assert [v["name"] for v in crd["versions"]] == [selector.version]
        status = crd["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True  # kopf writes peers


def test_two_peered_operators_watching_every_namespace(helm: str) -> None:
    docs = render(helm, "default")
    kinds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= kinds
    deployment = one(docs, "Deployment", PEERING)["spec"]
    assert deployment["replicas"] == 2
    assert deployment["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    args = operator_args(docs)
    assert f"--peering={PEERING}" in args and "--all-namespaces" in args
    # operator/main.py turns these into kopf.run(peering_name=..., standalone=False).
    options = parse_args(args)
    assert (options.peering_name, options.standalone, options.clusterwide) == (
        PEERING,
        False,
        True,
    )
    # Cluster-wide kopf peers through a ClusterKopfPeering of that name.
    peering = one(docs, "ClusterKopfPeering", PEERING)
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert "namespace" not in peering["metadata"]
    assert objects(docs, "KopfPeering") == {}
    role = one(docs, "ClusterRole", PEERING)
    assert {(g, r, v) for g, r, v in grants(role) if g == "kopf.dev"} == {
        ("kopf.dev", "clusterkopfpeerings", verb) for verb in PEERING_VERBS
    }
    anti = deployment["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == deployment["selector"]["matchLabels"]


def test_namespaced_operators_peer_in_each_watched_namespace(helm: str) -> None:
    docs = render(helm, "default", "--set", "operator.watchNamespaces={ml-a,ml-b}")
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["ml-a", "ml-b"]
    assert {p["metadata"]["name"] for p in peerings} == {PEERING}
    assert objects(docs, "ClusterKopfPeering") == {}
    assert f"--peering={PEERING}" in operator_args(docs)
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == PEERING]
    assert len(roles) == 2
    for role in roles:
        assert {(g, r, v) for g, r, v in grants(role) if g == "kopf.dev"} == {
            ("kopf.dev", "kopfpeerings", verb) for verb in PEERING_VERBS
        }


def test_one_operator_runs_standalone_without_peering(helm: str) -> None:
    docs = render(helm, "default", "--set", "operator.replicas=1")
    deployment = one(docs, "Deployment", PEERING)["spec"]
    assert deployment["replicas"] == 1
    assert deployment["strategy"] == {"type": "Recreate"}
    assert not [a for a in operator_args(docs) if a.startswith("--peering")]
    assert "affinity" not in deployment["template"]["spec"]
    assert objects(docs, "ClusterKopfPeering") == {}
    assert not [g for g, _, _ in grants(one(docs, "ClusterRole", PEERING)) if g == "kopf.dev"]
    assert parse_args(operator_args(docs)).standalone is True


def test_own_affinity_wins(helm: str) -> None:
    docs = render(
        helm,
        "default",
        "--set-json",
        'operator.affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":'
        '{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"In",'
        '"values":["system"]}]}]}}}',
    )
    spec = one(docs, "Deployment", PEERING)["spec"]["template"]["spec"]
    assert set(spec["affinity"]) == {"nodeAffinity"}
