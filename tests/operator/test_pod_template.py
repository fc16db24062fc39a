"""The member pod as a template: its hash, the drain hook, the startup probe and the
Hugging Face download step."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import SecretStr

from cachepoint.operator import pod as pod_module
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.pod import build_replica_pod, template_hash
from cachepoint.operator.spec import ReplicaSpec, SpecError, check, parse_spec, spec_problems

K8S_VERSION = "1.31"
CONFIG = OperatorConfig(
    nats_url="nats://n.cp.svc.cluster.local:4222", internal_token=SecretStr("t" * 40)
)
HASH = "cachepoint.dev/template-hash"
HF = {
    "repo": "meta-llama/Llama-3.1-8B-Instruct",
    "tokenSecret": {"name": "hf"},
    "storage": {"ephemeral": {"size": "40Gi", "storageClassName": "gp3"}},
}


def make_spec(**overrides: Any) -> ReplicaSpec:
    return parse_spec({"image": "replica:1", "model": {"name": "llama"}, **overrides})


def pod(spec: ReplicaSpec, index: int = 0, namespace: str = "serving") -> dict[str, Any]:
    return build_replica_pod(
        replica="llama", namespace=namespace, index=index, spec=spec, config=CONFIG
    )


def container(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["containers"][0]  # type: ignore[no-any-return]


# ----------------------------------------------------------------- template hash


def test_same_inputs_same_hash_and_every_member_shares_it() -> None:
    spec = make_spec(replicas=3)
    assert template_hash(spec, CONFIG) == template_hash(make_spec(replicas=3), CONFIG)
    hashes = {pod(spec, i)["metadata"]["annotations"][HASH] for i in range(3)}
    assert hashes == {template_hash(spec, CONFIG)}
    # The namespace is an identity too: the same spec elsewhere is the same template.
    assert pod(spec, 0, "other")["metadata"]["annotations"][HASH] in hashes


def test_a_builder_change_the_spec_does_not_see_changes_the_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec()
    before = template_hash(spec, CONFIG)
    monkeypatch.setattr(pod_module, "SHUTDOWN_MARGIN_SECONDS", 45)
    assert template_hash(spec, CONFIG) != before
    monkeypatch.undo()
    assert template_hash(spec, CONFIG) == before

    real = pod_module.build_probes

    def slower_readiness(spec: ReplicaSpec) -> dict[str, Any]:
        probes = real(spec)
        probes["readinessProbe"]["periodSeconds"] = 7
        return probes

    monkeypatch.setattr(pod_module, "build_probes", slower_readiness)
    assert template_hash(spec, CONFIG) != before
    # ... and the new pods carry the new hash, so the roll converges.
    manifest = pod(spec)
    assert manifest["metadata"]["annotations"][HASH] == template_hash(spec, CONFIG)
    assert container(manifest)["readinessProbe"]["periodSeconds"] == 7


def test_hash_follows_what_shapes_the_pod_only() -> None:
    base = template_hash(make_spec(), CONFIG)
    assert template_hash(make_spec(replicas=5), CONFIG) == base
    assert template_hash(make_spec(rollout={"maxUnavailable": 3}), CONFIG) == base
    assert template_hash(make_spec(drain={"gracePeriodSeconds": 60}), CONFIG) != base
    assert template_hash(make_spec(startupProbe={"failureThreshold": 360}), CONFIG) != base
    other_token = CONFIG.model_copy(update={"internal_token": SecretStr("u" * 40)})
    assert template_hash(make_spec(), other_token) != base  # held by reference in the pod


# ------------------------------------------------------------------------ drain


def test_pre_stop_drains_for_the_grace_and_the_pod_waits_longer() -> None:
    manifest = pod(make_spec(drain={"gracePeriodSeconds": 600}))
    hook = container(manifest)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python", "-m", "cachepoint.replica.prestop", "--timeout", "600"]
    grace = manifest["spec"]["terminationGracePeriodSeconds"]
    assert grace == 600 + pod_module.SHUTDOWN_MARGIN_SECONDS
    assert pod_module.SHUTDOWN_MARGIN_SECONDS > 0
    default = pod(make_spec())
    assert container(default)["lifecycle"]["preStop"]["exec"]["command"][-1] == "300"
    # The hook reads the replica's port and token from the pod env.
    names = {e["name"] for e in container(default)["env"]}
    assert {"CACHEPOINT_REPLICA_PORT", "CACHEPOINT_INTERNAL_TOKEN"} <= names


# ---------------------------------------------------------------- startup probe


def test_startup_probe_is_configurable_with_todays_defaults() -> None:
    probe = container(pod(make_spec()))["startupProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (10, 90)
    probe = container(pod(make_spec(startupProbe={"periodSeconds": 20, "failureThreshold": 180})))[
        "startupProbe"
    ]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (20, 180)
    with pytest.raises(SpecError, match=r"startupProbe\.failureThreshold"):
        make_spec(startupProbe={"failureThreshold": 0})


# ------------------------------------------------------------ Hugging Face weights


def test_hugging_face_download_runs_before_the_replica_into_a_per_member_claim() -> None:
    spec = make_spec(model={"name": "llama", "modelDir": "/models/llama", "huggingFace": HF})
    manifest = pod(spec)
    (init,) = manifest["spec"]["initContainers"]
    assert init["image"] == "replica:1"
    assert init["command"] == [
        "python",
        "-m",
        "cachepoint.replica.weights_fetch",
        "--repo",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--revision",
        "main",
        "--dest",
        "/models/llama",
    ]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert "nvidia.com/gpu" not in str(init["resources"])  # the GPUs wait for the replica
    volume = next(v for v in manifest["spec"]["volumes"] if v["name"] == "model")
    claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "40Gi"}},
        "storageClassName": "gp3",
    }
    writer = next(m for m in init["volumeMounts"] if m["name"] == "model")
    assert writer == {"name": "model", "mountPath": "/models/llama"}
    reader = next(m for m in container(manifest)["volumeMounts"] if m["name"] == "model")
    assert reader["readOnly"] is True
    assert manifest["spec"]["securityContext"]["fsGroup"] == 10001
    replica_env = {e["name"]: e.get("value") for e in container(manifest)["env"]}
    assert replica_env["CACHEPOINT_REPLICA_MODEL_DIR"] == "/models/llama"
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_hugging_face_on_a_shared_claim_with_a_revision_and_the_hub_from_env() -> None:
    source = {
        "repo": "org/model",
        "revision": "v1.0",
        "storage": {"claimName": "weights"},
    }
    spec = make_spec(
        model={"name": "m", "huggingFace": source},
        env=[{"name": "HF_ENDPOINT", "value": "https://hub.internal"}],
    )
    manifest = pod(spec)
    (init,) = manifest["spec"]["initContainers"]
    assert init["command"][init["command"].index("--revision") + 1] == "v1.0"
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert "HF_TOKEN" not in env  # a public repo needs none
    assert env["HF_ENDPOINT"] == "https://hub.internal"
    volume = next(v for v in manifest["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights"}
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert "initContainers" not in pod(make_spec())["spec"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"name": "m", "pvc": {"claimName": "w"}, "huggingFace": HF},
            "exclusive: give one weights source",
        ),
        (
            {"name": "m", "huggingFace": {**HF, "storage": {}}},
            "give one of claimName",
        ),
        (
            {
                "name": "m",
                "huggingFace": {
                    **HF,
                    "storage": {"claimName": "w", "ephemeral": {"size": "1Gi"}},
                },
            },
            "give one of claimName",
        ),
        (
            {"name": "m", "huggingFace": {**HF, "storage": {"ephemeral": {"size": "lots"}}}},
            "not a Kubernetes quantity",
        ),
    ],
    ids=["two-sources", "no-storage", "two-storages", "bad-size"],
)
def test_hugging_face_problems_are_clear(model: dict[str, Any], message: str) -> None:
    problems = spec_problems("r", make_spec(model=model))
    assert any(message in p for p in problems), problems
    with pytest.raises(SpecError, match=message):
        check("r", {"image": "i", "model": model})


def test_hugging_face_repo_and_defaults() -> None:
    spec = make_spec(model={"name": "m", "huggingFace": HF})
    source = spec.model.hugging_face
    assert source is not None
    assert (source.revision, source.token_secret and source.token_secret.key) == (
        "main",
        "HF_TOKEN",
    )
    assert spec.model.has_weights
    with pytest.raises(SpecError, match=r"huggingFace\.repo"):
        make_spec(model={"name": "m", "huggingFace": {**HF, "repo": "a b/c"}})
