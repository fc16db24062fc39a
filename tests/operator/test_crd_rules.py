"""The CRD's CEL rules (x-kubernetes-validations), evaluated with cel-python, against the
operator's own checks; and int-or-string on every quantity.

The API server refuses at `kubectl apply` what the operator would otherwise only report
in a condition. Both must agree: each case below is checked against the rules and
against cachepoint.operator.spec.check.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from cachepoint.bench.kube.apiserver.schema import apply_defaults
from cachepoint.operator.spec import ReplicaSpec, SpecError, check

CRD = Path(__file__).parents[2] / "charts/cachepoint/crds/cachereplicas.cachepoint.dev.yaml"
MINIMAL = {"image": "replica:1", "model": {"name": "m"}}
TIERS = {"hostBytes": "8Gi", "diskPath": "/kv", "diskBytes": "64Gi"}
HF = {"repo": "org/model", "storage": {"ephemeral": {"size": "40Gi"}}}
_ENV = celpy.Environment()


def root_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def rules_in(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path or "<root>", rule) for rule in schema.get("x-kubernetes-validations", [])]
    for key, prop in schema.get("properties", {}).items():
        found += rules_in(prop, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += rules_in(schema[key], f"{path}[*]")
    return found


def violations(value: Any, schema: dict[str, Any]) -> list[str]:
    """The message of every rule that fails, each rule evaluated at its own node."""
    messages = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, celpy.CELEvalError):
            raise AssertionError(f"rule {rule['rule']!r} failed to evaluate: {result}")
        if not result:
            messages.append(rule["message"])
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key in value:
                messages += violations(value[key], prop)
    return messages


def evaluate(name: str, spec: dict[str, Any]) -> list[str]:
    obj = {
        "apiVersion": "cachepoint.dev/v1alpha1",
        "kind": "CacheReplica",
        "metadata": {"name": name, "namespace": "serving"},
        "spec": spec,
    }
    schema = root_schema()
    return violations(apply_defaults(obj, schema), schema)


def test_every_rule_compiles_and_has_a_message() -> None:
    rules = rules_in(root_schema())
    where = {path for path, _ in rules}
    # The rules the CRD must enforce, at the nodes that can see their fields.
    assert {"<root>", ".spec", ".spec.model", ".spec.kv"} <= where
    assert ".spec.model.huggingFace.storage" in where
    for path, rule in rules:
        _ENV.compile(rule["rule"])  # raises on a rule cel-python cannot parse
        assert rule.get("message"), f"rule at {path} has no message"


VALID = [
    ("minimal", "r", MINIMAL),
    ("tp-within-gpus", "r", {**MINIMAL, "tensorParallelSize": 4, "gpusPerPod": 4}),
    ("cpu-any-tp", "r", {**MINIMAL, "tensorParallelSize": 4, "gpusPerPod": 0}),
    ("pvc", "r", {**MINIMAL, "model": {"name": "m", "pvc": {"claimName": "w"}}}),
    ("hugging-face", "r", {**MINIMAL, "model": {"name": "m", "huggingFace": HF}}),
    (
        "hugging-face-shared",
        "r",
        {
            **MINIMAL,
            "model": {"name": "m", "huggingFace": {**HF, "storage": {"claimName": "w"}}},
        },
    ),
    ("tiers", "r", {**MINIMAL, "kv": TIERS}),
    ("tiers-int", "r", {**MINIMAL, "kv": {**TIERS, "hostBytes": 1 << 30, "diskBytes": 1 << 34}}),
    ("no-disk-tier", "r", {**MINIMAL, "kv": {"diskBytes": "0Gi"}}),
    ("no-disk-tier-int", "r", {**MINIMAL, "kv": {"diskBytes": 0}}),
    ("longest-name", "x" * 56, MINIMAL),
    ("vllm-gpu", "r", {**MINIMAL, "engine": "vllm"}),
    (
        "vllm-cpu-block-32",
        "r",
        {**MINIMAL, "engine": "vllm", "gpusPerPod": 0, "kv": {"blockSize": 32}},
    ),
    (
        "vllm-zero-tiers",
        "r",
        {**MINIMAL, "engine": "vllm", "kv": {"hostBytes": "0Gi", "diskBytes": 0}},
    ),
    # vLLM's own host tier (its OffloadingConnector) on GPUs.
    ("vllm-gpu-host-tier", "r", {**MINIMAL, "engine": "vllm", "kv": {"hostBytes": "8Gi"}}),
    (
        "vllm-gpu-host-tier-int-empty-vllm",
        "r",
        {**MINIMAL, "engine": "vllm", "gpusPerPod": 2, "kv": {"hostBytes": 1 << 33}, "vllm": {}},
    ),
    ("vllm-retention-off", "r", {**MINIMAL, "engine": "vllm", "vllm": {"retention": False}}),
    (
        "vllm-cpu-zero-host-tier",
        "r",
        {**MINIMAL, "engine": "vllm", "gpusPerPod": 0, "kv": {"blockSize": 32, "hostBytes": 0}},
    ),
    (
        "torch-tiers-eviction",
        "r",
        {**MINIMAL, "engine": "torch", "kv": {**TIERS, "eviction": "slru"}},
    ),
]

INVALID = [
    ("tp-over-gpus", "r", {**MINIMAL, "tensorParallelSize": 4, "gpusPerPod": 2}, "gpusPerPod"),
    ("tp-over-default-gpus", "r", {**MINIMAL, "tensorParallelSize": 2}, "gpusPerPod"),
    (
        "pvc-and-host-path",
        "r",
        {**MINIMAL, "model": {"name": "m", "pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}},
        "one weights source",
    ),
    (
        "pvc-and-hugging-face",
        "r",
        {**MINIMAL, "model": {"name": "m", "pvc": {"claimName": "w"}, "huggingFace": HF}},
        "one weights source",
    ),
    (
        "hugging-face-two-storages",
        "r",
        {
            **MINIMAL,
            "model": {
                "name": "m",
                "huggingFace": {
                    **HF,
                    "storage": {"claimName": "w", "ephemeral": {"size": "1Gi"}},
                },
            },
        },
        "give one of claimName",
    ),
    (
        "hugging-face-no-storage",
        "r",
        {**MINIMAL, "model": {"name": "m", "huggingFace": {**HF, "storage": {}}}},
        "give one of claimName",
    ),
    (
        "disk-without-path",
        "r",
        {**MINIMAL, "kv": {"hostBytes": "8Gi", "diskBytes": "64Gi"}},
        "needs kv.diskPath",
    ),
    (
        "disk-without-host",
        "r",
        {**MINIMAL, "kv": {"diskPath": "/kv", "diskBytes": 1 << 34}},
        "needs kv.hostBytes",
    ),
    (
        "disk-with-zero-host",
        "r",
        {**MINIMAL, "kv": {**TIERS, "hostBytes": "0Gi"}},
        "needs kv.hostBytes",
    ),
    (
        "two-disk-volumes",
        "r",
        {**MINIMAL, "kv": {**TIERS, "diskVolume": {"emptyDir": {}, "hostPath": {"path": "/n"}}}},
        "exclusive: give one source",
    ),
    (
        "vllm-cpu-host-tier",
        "r",
        {
            **MINIMAL,
            "engine": "vllm",
            "gpusPerPod": 0,
            "kv": {"blockSize": 32, "hostBytes": "8Gi"},
        },
        "vLLM's CPU build (gpusPerPod 0) has no host tier",
    ),
    (
        "vllm-disk-tier",
        "r",
        {**MINIMAL, "engine": "vllm", "kv": TIERS},
        "kvcore's disk tier, which engine vllm does not have",
    ),
    (
        "vllm-settings-on-torch",
        "r",
        {**MINIMAL, "vllm": {"retention": False}},
        "applies to engine vllm only",
    ),
    (
        "vllm-eviction",
        "r",
        {**MINIMAL, "engine": "vllm", "kv": {"eviction": "lru"}},
        "vLLM's own LRU",
    ),
    (
        "vllm-cpu-block-16",
        "r",
        {**MINIMAL, "engine": "vllm", "gpusPerPod": 0},
        "multiples of 32",
    ),
    ("name-too-long", "x" * 57, MINIMAL, "at most 56 characters"),
    ("name-with-a-dot", "a.b", MINIMAL, "DNS label"),
]


@pytest.mark.parametrize(("name", "spec"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_specs_pass_the_rules_and_the_operator(name: str, spec: dict[str, Any]) -> None:
    assert evaluate(name, spec) == []
    check(name, spec)


@pytest.mark.parametrize(
    ("name", "spec", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_specs_fail_one_rule_and_the_operator(
    name: str, spec: dict[str, Any], message: str
) -> None:
    failed = evaluate(name, spec)
    assert len(failed) == 1, failed
    assert message in failed[0]
    # NOTE: the operator refuses the same spec, for an API server that ran no rules.
    with pytest.raises(SpecError):
        check(name, spec)


# ----------------------------------------------------------- int-or-string quantities


def _admits(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return _admits(typing.get_args(annotation)[0], kind)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_admits(a, kind) for a in typing.get_args(annotation))
    return False


def _quantity(annotation: Any, metadata: list[Any]) -> bool:
    """int | str, or an int parsed from a string (KVSize: a BeforeValidator on an int)."""
    if _admits(annotation, int) and _admits(annotation, str):
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata = [*metadata, *extra]
    parsers = [getattr(m, "func", None) for m in metadata]
    return annotation is int and any("size" in getattr(f, "__name__", "") for f in parsers)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def model_quantities(model: type[BaseModel], path: str = "") -> set[str]:
    """Paths (CRD spelling) of every field the operator reads as a quantity."""
    found = set()
    for name, field in model.model_fields.items():
        here = f"{path}.{to_camel(name)}"
        annotation = field.annotation
        nested = _model_of(annotation)
        if nested is not None:
            found |= model_quantities(nested, here)
        elif _quantity(annotation, field.metadata):
            found.add(here)
        elif typing.get_origin(annotation) is dict:  # resources: {kind: {name: quantity}}
            (_, inner) = typing.get_args(annotation)
            if typing.get_origin(inner) is dict and _quantity(typing.get_args(inner)[1], []):
                found.add(f"{here}[*][*]")
    return found


def crd_int_or_string(schema: dict[str, Any], path: str = "") -> set[str]:
    found = {path} if schema.get("x-kubernetes-int-or-string") else set()
    for key, prop in schema.get("properties", {}).items():
        found |= crd_int_or_string(prop, f"{path}.{key}")
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        found |= crd_int_or_string(extra, f"{path}[*]")
    return found


def test_every_quantity_is_int_or_string_in_the_crd() -> None:
    spec_schema = root_schema()["properties"]["spec"]
    wanted = model_quantities(ReplicaSpec)
    # The walk did find the kinds of quantity there are.
    assert {".kv.cacheBytes", ".kv.hostBytes", ".shmSize", ".resources[*][*]"} <= wanted
    assert ".model.huggingFace.storage.ephemeral.size" in wanted
    have = crd_int_or_string(spec_schema)
    # resources.limits / resources.requests spell out the kinds the model keys by name.
    have = {p.replace(".limits[*]", "[*][*]").replace(".requests[*]", "[*][*]") for p in have}
    assert wanted == have


EXAMPLES = sorted((Path(__file__).parents[2] / "charts/examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_rules_and_the_operator(example: Path) -> None:
    """What the docs tell users to `kubectl apply` is admitted, CEL rules included."""
    doc = yaml.safe_load(example.read_text())
    assert evaluate(doc["metadata"]["name"], doc["spec"]) == []
    check(doc["metadata"]["name"], doc["spec"])
