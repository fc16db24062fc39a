"""KV tiers through the chart: replicaDefaults.kv, the values schema, and the member pods
the operator builds from the rendered CacheReplicas (the disk tier's node-local volume)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.pod import build_replica_pod
from cachepoint.operator.spec import check

from .conftest import CHART, KUBE_VERSION, RELEASE, render, run_helm

SCENARIO = "kv-tiers-values"
GI = 2**30


def cache_replicas(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "CacheReplica"}


def member_pod(doc: dict[str, Any]) -> dict[str, Any]:
    name = doc["metadata"]["name"]
    spec = check(name, doc["spec"])
    return build_replica_pod(
        replica=name, namespace="cachepoint", index=0, spec=spec, config=OperatorConfig()
    )


def test_defaults_fill_what_an_entry_leaves_unset(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    replicas = cache_replicas(rendered[SCENARIO])
    assert replicas["llama-8b"]["spec"]["kv"] == {
        "hostBytes": "64Gi",
        "diskPath": "/var/cache/cachepoint",
        "diskBytes": "1Ti",
        "diskVolume": {"hostPath": {"path": "/mnt/nvme0/cachepoint"}},
    }
    own = replicas["llama-8b-host-only"]["spec"]["kv"]
    assert (own["hostBytes"], own["diskBytes"]) == ("16Gi", 0)  # the entry's own win


def test_empty_defaults_add_nothing(helm: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    tiny = cache_replicas(rendered["dev-cpu-values"])["tiny"]["spec"]
    assert tiny["kv"] == {"cacheBytes": "256MiB"}
    for doc in cache_replicas(rendered["gpu-replicas-values"]).values():
        assert not {"hostBytes", "diskPath", "diskBytes", "diskVolume"} & set(
            doc["spec"].get("kv", {})
        )
    docs = render(
        helm,
        "default",
        "--set",
        "replicas[0].name=bare",
        "--set",
        "replicas[0].model.name=m",
    )
    assert "kv" not in cache_replicas(docs)["bare"]["spec"]


def test_the_rendered_members_mount_the_node_local_disk(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    replicas = cache_replicas(rendered[SCENARIO])
    pod = member_pod(replicas["llama-8b"])
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kv-disk"]["hostPath"] == {"path": "/mnt/nvme0/cachepoint", "type": "Directory"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["kv-disk"]["mountPath"] == "/var/cache/cachepoint"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(64 * GI)
    assert env["CACHEPOINT_REPLICA_KV_DISK_BYTES"] == str(1024 * GI)
    assert env["CACHEPOINT_REPLICA_KV_DISK_PATH"] == "/var/cache/cachepoint"
    # 48Gi / 64Gi for the process, plus the 64Gi host tier.
    assert container["resources"]["requests"]["memory"] == "112Gi"
    assert container["resources"]["limits"]["memory"] == "128Gi"

    host_only = member_pod(replicas["llama-8b-host-only"])
    assert "kv-disk" not in {v["name"] for v in host_only["spec"]["volumes"]}
    env = {e["name"]: e.get("value") for e in host_only["spec"]["containers"][0]["env"]}
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(16 * GI)
    assert "CACHEPOINT_REPLICA_KV_DISK_BYTES" not in env


@pytest.mark.parametrize(
    "bad",
    [
        ["--set", "replicaDefaults.kv.hostBytes=lots"],
        ["--set", "replicaDefaults.kv.diskBytes=-1"],
        ["--set", "replicaDefaults.kv.diskPath=relative/kv"],
        ["--set", "replicaDefaults.kv.diskVolume.nfs.server=x"],
        ["--set", "replicaDefaults.kv.diskVolume.hostPath.type=File"],
        ["--set-json", 'replicaDefaults.kv.diskVolume={"emptyDir":{},"hostPath":{"path":"/x"}}'],
        ["--set", "replicaDefaults.kv.hostbytes=1Gi"],
        [
            "--set",
            "replicas[0].name=r",
            "--set",
            "replicas[0].model.name=m",
            "--set",
            "replicas[0].kv.diskBytes=8XB",
        ],
    ],
    ids=lambda args: args[-1],
)
def test_the_values_schema_rejects_bad_tiers(helm: str, bad: list[str]) -> None:
    with pytest.raises(AssertionError, match="values don't meet the specifications"):
        run_helm(helm, "template", RELEASE, CHART, "--kube-version", KUBE_VERSION, *bad)


def test_the_values_schema_accepts_sizes_as_numbers_or_text(helm: str) -> None:
    docs = render(
        helm,
        "default",
        "--set",
        "replicas[0].name=r",
        "--set",
        "replicas[0].model.name=m",
        "--set",
        "replicaDefaults.kv.hostBytes=34359738368",
        "--set",
        "replicas[0].kv.diskBytes=512GiB",
        "--set",
        "replicas[0].kv.diskPath=/kv",
    )
    kv = cache_replicas(docs)["r"]["spec"]["kv"]
    assert kv == {"hostBytes": 34359738368, "diskBytes": "512GiB", "diskPath": "/kv"}
    assert check("r", cache_replicas(docs)["r"]["spec"]).kv.host_bytes == 32 * GI
