"""The spec model against the CRD schema, and the checks beyond the schema."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cachepoint.bench.kube.apiserver.schema import apply_defaults
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.pod import template_hash
from cachepoint.operator.spec import SpecError, check, parse_spec, spec_problems

CRD = Path(__file__).parents[2] / "charts/cachepoint/crds/cachereplicas.cachepoint.dev.yaml"
MINIMAL = {"image": "replica:1", "model": {"name": "m"}}


def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def bounded_fields(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[Any]:
    for key, prop in schema.get("properties", {}).items():
        if "minimum" in prop or "maximum" in prop:
            yield (*path, key), prop
        yield from bounded_fields(prop, (*path, key))


def with_value(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(MINIMAL)
    node = spec
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return spec


def test_operator_defaults_equal_the_api_servers() -> None:
    defaulted = apply_defaults(MINIMAL, spec_schema())
    assert defaulted["kv"]["blockSize"] == 16  # the walk did reach nested defaults
    assert parse_spec(MINIMAL) == parse_spec(defaulted)


BOUNDED = list(bounded_fields(spec_schema()))


@pytest.mark.parametrize(("path", "prop"), BOUNDED, ids=[".".join(p) for p, _ in BOUNDED])
def test_operator_bounds_equal_the_schemas(path: tuple[str, ...], prop: dict[str, Any]) -> None:
    # An int-or-string size (kv.hostBytes) has no type; its minimum bounds the integers.
    step = 1 if prop.get("type", "integer") == "integer" else 0.001
    if "minimum" in prop:
        parse_spec(with_value(path, prop["minimum"]))
        with pytest.raises(SpecError):
            parse_spec(with_value(path, prop["minimum"] - step))
    if "maximum" in prop:
        parse_spec(with_value(path, prop["maximum"]))
        with pytest.raises(SpecError):
            parse_spec(with_value(path, prop["maximum"] + step))


def test_enums_equal_the_schemas() -> None:
    schema = spec_schema()
    for value in schema["properties"]["model"]["properties"]["dtype"]["enum"]:
        assert parse_spec(with_value(("model", "dtype"), value)).model.dtype == value
    for value in schema["properties"]["imagePullPolicy"]["enum"]:
        assert parse_spec(with_value(("imagePullPolicy",), value)).image_pull_policy == value
    with pytest.raises(SpecError, match="dtype"):
        parse_spec(with_value(("model", "dtype"), "int4"))


def test_eviction_names_equal_the_schemas_and_kvcores() -> None:
    from cachepoint.kvcore import EVICTION_POLICIES

    enum = spec_schema()["properties"]["kv"]["properties"]["eviction"]["enum"]
    assert set(enum) == set(EVICTION_POLICIES)
    for value in enum:
        assert parse_spec(with_value(("kv", "eviction"), value)).kv.eviction == value
    assert parse_spec(MINIMAL).kv.eviction is None  # unset: the replica's own default
    with pytest.raises(SpecError, match="eviction"):
        parse_spec(with_value(("kv", "eviction"), "mru"))
    # Unset, it changes no pod (adding the field rolls nothing); set, it does.
    config = OperatorConfig()
    unset = template_hash(parse_spec(MINIMAL), config)
    assert unset == template_hash(parse_spec(with_value(("kv", "eviction"), None)), config)
    assert unset != template_hash(parse_spec(with_value(("kv", "eviction"), "lru")), config)


def test_required_fields_are_reported_with_their_path() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec({"model": {}})
    assert "spec.image: Field required" in caught.value.problems
    assert "spec.model.name: Field required" in caught.value.problems


def test_tp_beyond_the_pods_gpus_is_a_problem_on_gpu_only() -> None:
    assert (
        spec_problems("r", parse_spec({**MINIMAL, "tensorParallelSize": 2, "gpusPerPod": 2})) == []
    )
    (problem,) = spec_problems(
        "r", parse_spec({**MINIMAL, "tensorParallelSize": 4, "gpusPerPod": 2})
    )
    assert "gpusPerPod is 2" in problem
    # On the CPU (no GPUs) the ranks are processes sharing the cores: any TP may run.
    assert (
        spec_problems("r", parse_spec({**MINIMAL, "tensorParallelSize": 4, "gpusPerPod": 0})) == []
    )


def test_tp_must_divide_the_heads_when_known() -> None:
    model = {"name": "m", "numAttentionHeads": 32, "numKeyValueHeads": 6}
    spec = parse_spec({**MINIMAL, "model": model, "tensorParallelSize": 4, "gpusPerPod": 4})
    assert spec_problems("r", spec) == [
        "tensorParallelSize 4 does not divide model.numKeyValueHeads 6"
    ]
    spec = parse_spec({**MINIMAL, "model": model, "tensorParallelSize": 2, "gpusPerPod": 2})
    assert spec_problems("r", spec) == []


def test_name_and_weights_source_problems() -> None:
    long_name = "x" * 57
    spec = parse_spec(
        {**MINIMAL, "model": {"name": "m", "pvc": {"claimName": "w"}, "hostPath": {"path": "/w"}}}
    )
    problems = spec_problems(long_name, spec)
    assert len(problems) == 2
    assert "DNS label" in problems[0]
    assert "exclusive" in problems[1]
    with pytest.raises(SpecError) as caught:
        check("Bad.Name", MINIMAL)
    assert "DNS label" in str(caught.value)
    assert check("good", MINIMAL).replicas == 1
