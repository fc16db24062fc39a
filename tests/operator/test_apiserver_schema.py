"""Custom resources go through their CRD's structural schema: pruning, defaults, validation, CEL.

Own small CRD here (a Widget), so these tests do not depend on what the chart's CRD
holds today; the last tests load the chart's CRD as it is on disk.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cachepoint.bench.kube.apiserver import cel, chart
from cachepoint.bench.kube.apiserver.schema import CustomResource, apply_defaults, prune, validate
from cachepoint.bench.kube.apiserver.status import ApiError
from cachepoint.bench.kube.emulator import ApiServer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["size"],
            "x-kubernetes-validations": [
                {"rule": "self.size <= self.limit", "message": "size must be at most limit"},
                {
                    "rule": "!has(self.frozen) || self.size == oldSelf.size",
                    "messageExpression": "'size is frozen at ' + string(oldSelf.size)",
                },
            ],
            "properties": {
                "size": {"type": "integer", "minimum": 1, "maximum": 64},
                "limit": {"type": "integer", "default": 8},
                "mode": {"type": "string", "enum": ["a", "b"], "default": "a"},
                "frozen": {"type": "boolean"},
                "quantity": {"x-kubernetes-int-or-string": True},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "name": {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"},
            },
        },
        "status": {"type": "object", "properties": {"ready": {"type": "integer"}}},
    },
}
CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.dev"},
    "spec": {
        "group": "example.dev",
        "scope": "Namespaced",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": SCHEMA},
            }
        ],
    },
}
PATH = "/apis/example.dev/v1/namespaces/ns/widgets"
MERGE = {"Content-Type": "application/merge-patch+json"}


def widget(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "example.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "ns"},
        "spec": spec,
    }


@pytest.fixture
def server(kmock: ApiServer) -> ApiServer:
    kmock.install_crd(CRD)
    return kmock


def messages(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    stored = apply_defaults(prune(obj, SCHEMA, root=True), SCHEMA)
    return [str(e) for e in validate(stored, SCHEMA, "", old if old is not None else ...)]


def test_unknown_fields_are_pruned_except_where_preserved() -> None:
    obj = widget(size=1, typo=3, free={"anything": {"goes": 1}}, labels={"k": "v"})
    obj["metadata"]["annotations"] = {"a": "b"}  # metadata is the server's, never pruned
    obj["extra"] = True
    pruned = prune(obj, SCHEMA, root=True)
    assert "extra" not in pruned and "typo" not in pruned["spec"]
    assert pruned["spec"]["free"] == {"anything": {"goes": 1}}
    assert pruned["spec"]["labels"] == {"k": "v"}
    assert pruned["metadata"]["annotations"] == {"a": "b"}


def test_defaults_fill_absent_and_null_fields() -> None:
    obj = widget(size=1, mode=None)
    stored = apply_defaults(prune(obj, SCHEMA, root=True), SCHEMA)
    assert stored["spec"] == {"size": 1, "limit": 8, "mode": "a"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "spec.size: Required value"),
        (
            {"size": "2"},
            'spec.size: Invalid value: "2": spec.size in body must be of type integer: "string"',
        ),
        (
            {"size": 65, "limit": 100},
            "spec.size: Invalid value: 65: spec.size in body should be less than or equal to 64",
        ),
        (
            {"size": 1, "mode": "c"},
            'spec.mode: Unsupported value: "c": supported values: "a", "b"',
        ),
        (
            {"size": 1, "name": "toolong"},
            'spec.name: Invalid value: "toolong": spec.name in body should be at most 5 chars long',
        ),
        (
            {"size": 1, "name": "AB"},
            "spec.name: Invalid value: \"AB\": spec.name in body should match '^[a-z]+$'",
        ),
        (
            {"size": 1, "quantity": 1.5},
            "spec.quantity: Invalid value: 1.5: spec.quantity in body must be of type"
            " int-or-string",
        ),
        ({"size": 9}, 'spec: Invalid value: "object": size must be at most limit'),
    ],
)
def test_invalid_values_are_worded_like_the_api_server(spec: dict[str, Any], message: str) -> None:
    assert messages(widget(**spec)) == [message]


def test_int_or_string_takes_both() -> None:
    assert messages(widget(size=1, quantity="1Gi")) == []
    assert messages(widget(size=1, quantity=3)) == []


def test_transition_rules_see_the_old_object_only_on_update() -> None:
    frozen = widget(size=2, frozen=True)
    assert messages(frozen) == []  # create: no oldSelf, the rule is skipped
    old = apply_defaults(prune(widget(size=3), SCHEMA, root=True), SCHEMA)
    assert messages(frozen, old) == ['spec: Invalid value: "object": size is frozen at 3']
    assert messages(widget(size=3, frozen=True), old) == []


def test_a_rule_that_does_not_compile_fails_the_crd() -> None:
    bad = copy.deepcopy(CRD)
    spec = bad["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": "self.size <= ("}]
    with pytest.raises(cel.RuleError):
        CustomResource.from_crd(bad)


async def test_an_invalid_create_gets_422_with_causes(server: ApiServer) -> None:
    response = await server.post(PATH, json=widget(size=9, limit=4))
    assert response.status == 422
    body = await response.json()
    assert body["reason"] == "Invalid"
    assert body["message"] == (
        'Widget.example.dev "w" is invalid: spec: Invalid value: "object": size must be at most'
        " limit"
    )
    assert body["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "object": size must be at most limit',
            "field": "spec",
        }
    ]
    assert server.current(_res(server), "ns", "w") is None


def _res(server: ApiServer) -> Any:
    return next(r for r in server.resources if r.plural == "widgets")


async def test_a_valid_create_is_stored_pruned_and_defaulted(server: ApiServer) -> None:
    response = await server.post(PATH, json=widget(size=2, typo=1))
    assert response.status == 201, await response.text()
    stored = server.current(_res(server), "ns", "w")
    assert stored is not None
    assert stored["spec"] == {"size": 2, "limit": 8, "mode": "a"}
    assert (await response.json())["spec"] == stored["spec"]


async def test_an_update_is_validated_against_the_whole_object(server: ApiServer) -> None:
    assert (await server.post(PATH, json=widget(size=2))).status == 201
    response = await server.patch(f"{PATH}/w", json={"spec": {"limit": 1}}, headers=MERGE)
    assert response.status == 422
    assert "size must be at most limit" in (await response.json())["message"]
    frozen = await server.patch(f"{PATH}/w", json={"spec": {"frozen": True}}, headers=MERGE)
    assert frozen.status == 200, await frozen.text()
    grow = await server.patch(f"{PATH}/w", json={"spec": {"size": 3}}, headers=MERGE)
    assert grow.status == 422
    assert "size is frozen at 2" in (await grow.json())["message"]


async def test_status_writes_are_validated_and_pruned(server: ApiServer) -> None:
    assert (await server.post(PATH, json=widget(size=2))).status == 201
    bad = await server.patch(f"{PATH}/w/status", json={"status": {"ready": "x"}}, headers=MERGE)
    assert bad.status == 422
    ok = await server.patch(
        f"{PATH}/w/status", json={"status": {"ready": 1, "unknown": 2}}, headers=MERGE
    )
    assert ok.status == 200
    assert server.current(_res(server), "ns", "w")["status"] == {"ready": 1}


async def test_a_server_without_cel_applies_only_the_openapi_checks(server: ApiServer) -> None:
    server.cel_rules = False
    assert (await server.post(PATH, json=widget(size=9, limit=4))).status == 201
    assert (
        await server.post(PATH, json={**widget(size=0), "metadata": {"name": "v"}})
    ).status == 422


def test_the_charts_crds_load_and_their_rules_compile() -> None:
    crds = chart.crds()
    served = [s for crd in crds for s in CustomResource.from_crd(crd)]
    cache_replica = next(s for s in served if s.kind == "CacheReplica")
    obj = {
        "apiVersion": "cachepoint.dev/v1alpha1",
        "kind": "CacheReplica",
        "metadata": {"name": "llama", "namespace": "serving"},
        "spec": {"image": "i", "model": {"name": "m"}, "surprise": 1},
    }
    stored = cache_replica.admit(obj, None)
    assert "surprise" not in stored["spec"]
    assert stored["spec"]["replicas"] == 1  # the CRD's default


def test_the_charts_crd_refuses_max_waiting_zero() -> None:
    """``batching.maxWaiting: 0`` would refuse every request; the API server says so
    at apply time (the replica's settings refuse it too, for a pod started by hand)."""
    crd = next(s for crd in chart.crds() for s in CustomResource.from_crd(crd))
    assert crd.kind == "CacheReplica"
    obj = {
        "apiVersion": "cachepoint.dev/v1alpha1",
        "kind": "CacheReplica",
        "metadata": {"name": "llama", "namespace": "serving"},
        "spec": {"image": "i", "model": {"name": "m"}, "batching": {"maxWaiting": 0}},
    }
    with pytest.raises(ApiError) as err:
        crd.admit(obj, None)
    assert err.value.code == 422
    assert "spec.batching.maxWaiting" in err.value.message
    obj["spec"]["batching"]["maxWaiting"] = 1
    assert crd.admit(obj, None)["spec"]["batching"]["maxWaiting"] == 1
