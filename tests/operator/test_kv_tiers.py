"""KV tiers in a CacheReplica: spec checks, CRD schema, and the member pod they build."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.pod import build_replica_pod, template_hash
from cachepoint.operator.sizes import (
    KV_SIZE_PATTERN,
    KV_UNITS,
    add_quantity,
    format_quantity,
    parse_kv_size,
    parse_quantity,
)
from cachepoint.operator.spec import ReplicaSpec, SpecError, check, parse_spec, spec_problems

CRD = Path(__file__).parents[2] / "charts/cachepoint/crds/cachereplicas.cachepoint.dev.yaml"
CONFIG = OperatorConfig(nats_url="nats://nats:4222")
GI = 2**30
TIERS = {"hostBytes": "32Gi", "diskPath": "/var/cache/kv", "diskBytes": "512Gi"}


def make_spec(kv: dict[str, Any] | None = None, **overrides: Any) -> ReplicaSpec:
    return parse_spec(
        {"image": "replica:1", "model": {"name": "llama"}, "kv": kv or {}, **overrides}
    )


def pod(spec: ReplicaSpec) -> dict[str, Any]:
    return build_replica_pod(
        replica="llama", namespace="serving", index=0, spec=spec, config=CONFIG
    )


def container(spec: ReplicaSpec) -> dict[str, Any]:
    return pod(spec)["spec"]["containers"][0]  # type: ignore[no-any-return]


def env_of(spec: ReplicaSpec) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(spec)["env"]}


def env_list(spec: ReplicaSpec) -> list[dict[str, Any]]:
    return container(spec)["env"]  # type: ignore[no-any-return]


def volume(spec: ReplicaSpec, name: str = "kv-disk") -> dict[str, Any] | None:
    return next((v for v in pod(spec)["spec"]["volumes"] if v["name"] == name), None)


def mount(spec: ReplicaSpec, name: str = "kv-disk") -> dict[str, Any] | None:
    return next((m for m in container(spec)["volumeMounts"] if m["name"] == name), None)


# ------------------------------------------------------------------------- sizes


def test_kv_sizes_read_like_the_replicas() -> None:
    from cachepoint.replica import settings

    assert KV_UNITS == settings._UNITS
    for text in ("8Gi", "8GiB", "8g", "1.5Ti", "512Mi", "100", "64 KiB"):
        assert parse_kv_size(text) == settings.parse_bytes(text)
        assert re.match(KV_SIZE_PATTERN, text)
    for bad in ("8Pi", "lots", "-1Gi", "8 G B", ""):
        with pytest.raises(ValueError, match="not a size"):
            parse_kv_size(bad)
        assert not re.match(KV_SIZE_PATTERN, bad)
    with pytest.raises(ValueError, match="negative"):
        parse_kv_size(-1)


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("64Gi", 64 * GI),
        ("64G", 64 * 10**9),
        ("500M", 500 * 10**6),
        ("1e9", 10**9),
        ("1.5Gi", 3 * GI // 2),
        ("129e6", 129 * 10**6),
        (1024, 1024),
        ("1024", 1024),
        ("100m", 1),  # a milli-byte rounds up to a whole byte
    ],
)
def test_kubernetes_quantities(quantity: int | str, expected: int) -> None:
    assert parse_quantity(quantity) == expected


def test_quantity_arithmetic_stays_exact() -> None:
    assert format_quantity(96 * GI) == "96Gi"
    assert format_quantity(GI + 2**20) == "1025Mi"
    assert format_quantity(1000) == "1000"
    assert add_quantity("64G", 32 * GI) == "96054432Ki"  # 64e9 + 32Gi, exactly
    assert parse_quantity(add_quantity("64G", 32 * GI)) == 64 * 10**9 + 32 * GI
    assert add_quantity("64Gi", 32 * GI) == "96Gi"
    for bad in ("lots", "1.2.3Gi", "8XB"):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            parse_quantity(bad)


# ------------------------------------------------------------------- the spec


def test_tiers_are_off_by_default_and_keep_old_pods() -> None:
    spec = make_spec()
    assert (spec.kv.host_bytes, spec.kv.disk_path, spec.kv.disk_bytes) == (0, None, 0)
    # Unset, the tier fields render nothing in the pod: adding them rolls nothing.
    assert not any("KV_HOST" in e["name"] or "KV_DISK" in e["name"] for e in env_list(spec))
    assert template_hash(make_spec(kv={"hostBytes": 0}), CONFIG) == template_hash(spec, CONFIG)
    assert template_hash(make_spec(kv={"hostBytes": "1Gi"}), CONFIG) != template_hash(spec, CONFIG)


def test_sizes_are_parsed_into_bytes() -> None:
    kv = make_spec(kv=TIERS).kv
    assert (kv.host_bytes, kv.disk_bytes) == (32 * GI, 512 * GI)
    assert make_spec(kv={"hostBytes": 1 << 20}).kv.host_bytes == 1 << 20
    with pytest.raises(SpecError, match=r"spec\.kv\.hostBytes: Value error, not a size"):
        make_spec(kv={"hostBytes": "lots"})
    with pytest.raises(SpecError, match=r"spec\.kv\.diskPath"):
        make_spec(kv={**TIERS, "diskPath": "relative/kv"})


@pytest.mark.parametrize(
    ("kv", "problem"),
    [
        (
            {"hostBytes": "8Gi", "diskBytes": "100Gi"},
            "kv.diskBytes needs kv.diskPath: where the disk tier is mounted",
        ),
        (
            {"diskPath": "/kv", "diskBytes": "100Gi"},
            "kv.diskBytes needs kv.hostBytes > 0: the disk tier sits behind the host tier",
        ),
        ({**TIERS, "diskPath": "/dev/shm/kv"}, "overlaps /dev/shm or model.modelDir"),
        ({**TIERS, "diskPath": "/models"}, "overlaps /dev/shm or model.modelDir"),
        (
            {**TIERS, "diskVolume": {"emptyDir": {}, "hostPath": {"path": "/mnt/nvme"}}},
            "kv.diskVolume: emptyDir, hostPath and ephemeral are exclusive",
        ),
        (
            {**TIERS, "diskVolume": {"emptyDir": {"sizeLimit": "huge"}}},
            "kv.diskVolume.emptyDir.sizeLimit: not a Kubernetes quantity: 'huge'",
        ),
        (
            {**TIERS, "diskVolume": {"emptyDir": {"sizeLimit": "500Gi"}}},
            "kv.diskVolume.emptyDir.sizeLimit 500Gi is smaller than kv.diskBytes",
        ),
        (
            {**TIERS, "diskVolume": {"ephemeral": {"size": "512G"}}},
            "kv.diskVolume.ephemeral.size 512G is smaller than kv.diskBytes",
        ),
    ],
)
def test_tier_problems_are_reported(kv: dict[str, Any], problem: str) -> None:
    problems = spec_problems("r", make_spec(kv=kv))
    assert any(problem in p for p in problems), problems
    with pytest.raises(SpecError):
        check("r", {"image": "replica:1", "model": {"name": "m"}, "kv": kv})


def test_a_bad_memory_quantity_is_a_problem_only_with_a_host_tier() -> None:
    bad = {"limits": {"memory": "lots"}}
    (problem,) = spec_problems("r", make_spec(kv={"hostBytes": "1Gi"}, resources=bad))
    assert problem == "resources.limits.memory: not a Kubernetes quantity: 'lots'"
    assert spec_problems("r", make_spec(resources=bad)) == []


def test_a_disk_path_without_a_size_is_no_disk_tier() -> None:
    spec = make_spec(kv={"hostBytes": "1Gi", "diskPath": "/kv"})
    assert spec_problems("r", spec) == []
    assert "CACHEPOINT_REPLICA_KV_DISK_PATH" not in env_of(spec)
    assert volume(spec) is None


# --------------------------------------------------------------- the member pod


def test_tiers_reach_the_replica_as_byte_counts() -> None:
    env = env_of(make_spec(kv=TIERS))
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(32 * GI)
    assert env["CACHEPOINT_REPLICA_KV_DISK_PATH"] == "/var/cache/kv"
    assert env["CACHEPOINT_REPLICA_KV_DISK_BYTES"] == str(512 * GI)
    off = env_of(make_spec())
    assert not [name for name in off if name.startswith("CACHEPOINT_REPLICA_KV_")]


def test_the_replica_reads_the_env_the_operator_writes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from cachepoint.replica.settings import ReplicaSettings

    spec = make_spec(kv={**TIERS, "diskPath": str(tmp_path / "kv")})
    for name, value in env_of(spec).items():
        if name.startswith("CACHEPOINT_REPLICA_KV_"):
            monkeypatch.setenv(name, value)
    settings = ReplicaSettings()
    assert settings.kv_host_bytes == spec.kv.host_bytes
    assert settings.kv_disk_bytes == spec.kv.disk_bytes
    assert settings.kv_disk_path == tmp_path / "kv"


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        # Both given: both raised.
        (
            {"requests": {"memory": "48Gi"}, "limits": {"memory": "64Gi"}},
            {"requests": {"memory": "80Gi"}, "limits": {"memory": "96Gi"}},
        ),
        # Only a limit: the request defaults to it, so it is raised alone.
        ({"limits": {"memory": "64Gi"}}, {"limits": {"memory": "96Gi"}}),
        # Only a request: raised; no limit is invented.
        ({"requests": {"memory": "1G"}}, {"requests": {"memory": str(10**9 + 32 * GI)}}),
        # Neither: the host tier is requested, so the pod lands on a node with the RAM.
        ({}, {"requests": {"memory": "32Gi"}}),
    ],
)
def test_the_host_tier_raises_the_pods_memory(
    resources: dict[str, Any], expected: dict[str, Any]
) -> None:
    spec = make_spec(kv={"hostBytes": "32Gi"}, resources=resources, gpusPerPod=0)
    assert container(spec)["resources"] == expected
    assert spec.resources == resources  # the spec itself is untouched


def test_the_default_disk_volume_is_an_empty_dir_with_headroom() -> None:
    spec = make_spec(kv=TIERS, gpusPerPod=0)
    size = volume(spec)["emptyDir"]["sizeLimit"]  # type: ignore[index]
    # 512Gi + 1/32 + 64Mi, in whole MiB: the files alone can never reach the limit.
    assert size == format_quantity(512 * GI + 16 * GI + 64 * 2**20) == "540736Mi"
    assert mount(spec) == {"name": "kv-disk", "mountPath": "/var/cache/kv"}
    # On the node's disk, so requested as ephemeral storage.
    assert container(spec)["resources"]["requests"]["ephemeral-storage"] == size
    given = make_spec(kv={**TIERS, "diskVolume": {"emptyDir": {"sizeLimit": "600Gi"}}})
    assert volume(given)["emptyDir"] == {"sizeLimit": "600Gi"}  # type: ignore[index]
    limited = make_spec(kv=TIERS, resources={"limits": {"ephemeral-storage": "10Gi"}})
    assert container(limited)["resources"]["limits"]["ephemeral-storage"] == "550976Mi"


def test_a_host_path_disk_gives_each_member_its_own_directory() -> None:
    spec = make_spec(kv={**TIERS, "diskVolume": {"hostPath": {"path": "/mnt/nvme0/cp"}}})
    assert volume(spec) == {
        "name": "kv-disk",
        "hostPath": {"path": "/mnt/nvme0/cp", "type": "Directory"},
    }
    assert mount(spec) == {
        "name": "kv-disk",
        "mountPath": "/var/cache/kv",
        "subPathExpr": "$(POD_NAME)",
    }
    assert env_of(spec)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Not the pod's ephemeral storage: nothing to request.
    assert "ephemeral-storage" not in str(container(spec)["resources"])


def test_an_ephemeral_claim_from_a_local_storage_class() -> None:
    source = {"ephemeral": {"storageClassName": "local-nvme"}}
    spec = make_spec(kv={**TIERS, "diskVolume": source})
    claim = volume(spec)["ephemeral"]["volumeClaimTemplate"]["spec"]  # type: ignore[index]
    # 512Gi + 1/8 (ext4 keeps 5% for root) + 64Mi.
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "local-nvme",
        "resources": {"requests": {"storage": "589888Mi"}},
    }
    security = pod(spec)["spec"]["securityContext"]
    assert (security["fsGroup"], security["fsGroupChangePolicy"]) == (10001, "OnRootMismatch")
    assert "fsGroup" not in pod(make_spec(kv=TIERS))["spec"]["securityContext"]
    sized = make_spec(kv={**TIERS, "diskVolume": {"ephemeral": {"size": "1Ti"}}})
    claim = volume(sized)["ephemeral"]["volumeClaimTemplate"]["spec"]  # type: ignore[index]
    assert claim["resources"] == {"requests": {"storage": "1Ti"}}
    assert "storageClassName" not in claim


@pytest.mark.parametrize(
    "disk_volume",
    [None, {"hostPath": {"path": "/mnt/nvme"}}, {"ephemeral": {"storageClassName": "local"}}],
    ids=["emptyDir", "hostPath", "ephemeral"],
)
def test_tiered_pods_are_valid_kubernetes_objects(disk_volume: dict[str, Any] | None) -> None:
    kv: dict[str, Any] = {**TIERS, "diskVolume": disk_volume} if disk_volume else TIERS
    spec = make_spec(kv=kv, resources={"limits": {"memory": "64Gi"}})
    kubernetes_validate.validate(pod(spec), "1.31", strict=True)


# ---------------------------------------------------------------- the CRD schema


def kv_schema_errors(kv: dict[str, Any]) -> list[str]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    doc = {"spec": {"image": "replica:1", "model": {"name": "m"}, "kv": kv}}
    return [".".join(map(str, e.path)) for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


@pytest.mark.parametrize(
    "kv",
    [
        TIERS,
        {"hostBytes": 34359738368, "diskPath": "/kv", "diskBytes": 0},
        {**TIERS, "diskVolume": {"hostPath": {"path": "/mnt/nvme", "type": "DirectoryOrCreate"}}},
        {**TIERS, "diskVolume": {"ephemeral": {"storageClassName": "local", "size": "1Ti"}}},
        {**TIERS, "diskVolume": {"emptyDir": {"sizeLimit": "600Gi"}}},
    ],
)
def test_the_crd_accepts_tiers(kv: dict[str, Any]) -> None:
    assert kv_schema_errors(kv) == []


@pytest.mark.parametrize(
    ("kv", "where"),
    [
        ({"hostBytes": -1}, "spec.kv.hostBytes"),
        ({"hostBytes": "lots"}, "spec.kv.hostBytes"),
        ({"hostBytes": 1.5}, "spec.kv.hostBytes"),
        ({"diskBytes": "-5Gi"}, "spec.kv.diskBytes"),
        ({"diskPath": "kv"}, "spec.kv.diskPath"),
        ({"diskVolume": {"hostPath": {}}}, "spec.kv.diskVolume.hostPath"),
        ({"diskVolume": {"hostPath": {"path": "/x", "type": "File"}}}, "spec.kv.diskVolume"),
    ],
)
def test_the_crd_rejects_bad_tiers(kv: dict[str, Any], where: str) -> None:
    errors = kv_schema_errors(kv)
    assert errors
    assert all(e.startswith(where) for e in errors), errors


# ------------------------------------------------------------------ engine vllm

VLLM_HOST = {"hostBytes": "32Gi"}


def vllm_spec(kv: dict[str, Any] | None = None, **overrides: Any) -> ReplicaSpec:
    return make_spec(kv=kv, engine="vllm", **{"gpusPerPod": 1, **overrides})


def test_a_gpu_vllm_member_gets_vllms_host_tier_in_its_env_and_memory() -> None:
    spec = vllm_spec(
        VLLM_HOST, resources={"requests": {"memory": "48Gi"}, "limits": {"memory": "64Gi"}}
    )
    assert spec_problems("r", spec) == []
    env = env_of(spec)
    assert env["CACHEPOINT_REPLICA_ENGINE"] == "vllm"
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(32 * GI)
    assert "CACHEPOINT_REPLICA_KV_DISK_BYTES" not in env
    # Retention is the replica's default (on): nothing rendered for it.
    assert "CACHEPOINT_REPLICA_VLLM_RETENTION" not in env
    # vLLM's OffloadingConnector pins that much host memory: the pod is sized for it,
    # exactly as for torch's host tier.
    assert container(spec)["resources"] == {
        "requests": {"memory": "80Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "96Gi", "nvidia.com/gpu": "1"},
    }
    torch = make_spec(kv=VLLM_HOST, resources=spec.resources)
    assert container(torch)["resources"] == container(spec)["resources"]
    kubernetes_validate.validate(pod(spec), "1.31", strict=True)


def test_vllm_retention_off_reaches_the_replica_and_on_rolls_nothing() -> None:
    off = vllm_spec(vllm={"retention": False})
    assert spec_problems("r", off) == []
    assert env_of(off)["CACHEPOINT_REPLICA_VLLM_RETENTION"] == "false"
    unset, on = vllm_spec(), vllm_spec(vllm={"retention": True})
    assert "CACHEPOINT_REPLICA_VLLM_RETENTION" not in env_of(on)
    assert template_hash(on, CONFIG) == template_hash(unset, CONFIG)
    assert template_hash(off, CONFIG) != template_hash(unset, CONFIG)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            {"gpusPerPod": 0, "kv": {"blockSize": 32, **VLLM_HOST}},
            "kv.hostBytes with engine vllm is vLLM's OffloadingConnector, which runs on GPUs "
            "only: vLLM's CPU build (gpusPerPod 0) has no host tier",
        ),
        ({"kv": TIERS}, "kv.diskBytes is kvcore's disk tier, which engine vllm does not have"),
        ({"kv": {"eviction": "slru"}}, "kv.eviction is a kvcore policy"),
        ({"engine": "torch", "vllm": {"retention": False}}, "applies to engine vllm only"),
    ],
    ids=["cpu-host-tier", "disk-tier", "eviction", "vllm-on-torch"],
)
def test_what_engine_vllm_cannot_run_is_refused(overrides: dict[str, Any], problem: str) -> None:
    raw = {"image": "replica:1", "model": {"name": "m"}, "engine": "vllm", **overrides}
    (found,) = spec_problems("r", parse_spec(raw))
    assert problem in found
    with pytest.raises(SpecError):
        check("r", raw)


def replica_settings_from(spec: ReplicaSpec, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What `cachepoint-replica` would run with in the member pod: its command line
    through the real flag parser, and its env (the pod's plain values, and a stand-in
    for each Secret the kubelet would read)."""
    import os

    from cachepoint.replica.cli import build_parser
    from cachepoint.replica.settings import ReplicaSettings
    from cachepoint.runtime.serve import settings_from_flags

    for name in list(os.environ):
        if name.startswith("CACHEPOINT_"):
            monkeypatch.delenv(name)
    box = container(spec)
    for name, value in env_of(spec).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
        elif "secretKeyRef" in value:  # what the kubelet reads from the Secret
            monkeypatch.setenv(name, f"secret-{name.lower()}")
    command = [*box["command"], *box.get("args", [])]
    assert command[0] == "cachepoint-replica"
    parser = build_parser()
    return settings_from_flags(parser, parser.parse_args(command[1:]), ReplicaSettings)


def test_a_gpu_vllm_member_runs_retention_then_vllms_offloader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cachepoint.replica.vllm_engine.engine import (
        RETENTION_CONNECTOR,
        RETENTION_MODULE,
        connector_config,
    )

    spec = vllm_spec(VLLM_HOST)
    settings = replica_settings_from(spec, monkeypatch)
    assert (settings.engine, settings.device) == ("vllm", "cuda")
    assert settings.kv_host_bytes == 32 * GI
    assert settings.vllm_retention is True
    assert connector_config(settings, "cuda") == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": RETENTION_CONNECTOR,
                    "kv_connector_module_path": RETENTION_MODULE,
                    "kv_role": "kv_both",
                },
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 32 * GI},
                },
            ]
        },
    }


def test_a_gpu_vllm_member_without_retention_runs_the_offloader_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cachepoint.replica.vllm_engine.engine import connector_config

    settings = replica_settings_from(vllm_spec(VLLM_HOST, vllm={"retention": False}), monkeypatch)
    assert settings.vllm_retention is False
    assert connector_config(settings, "cuda") == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 32 * GI},
    }
    plain = replica_settings_from(vllm_spec(vllm={"retention": False}), monkeypatch)
    assert connector_config(plain, "cuda") is None


def test_the_operator_refuses_what_the_cpu_replica_would_refuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cachepoint.replica.vllm_engine.engine import VllmConfigError, connector_config

    # Built despite the refusal, to show the replica would refuse it too at start.
    spec = vllm_spec({"blockSize": 32, **VLLM_HOST}, gpusPerPod=0)
    assert spec_problems("r", spec)
    settings = replica_settings_from(spec, monkeypatch)
    assert settings.device == "cpu"
    with pytest.raises(VllmConfigError, match="GPUs only"):
        connector_config(settings, settings.device)
