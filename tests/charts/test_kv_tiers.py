"""KV tiers through the chart: replicaDefaults.kv, the values schema, and the member pods
the operator builds from the rendered CacheReplicas (the disk tier's node-local volume)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from cachepoint.bench.kube.apiserver import chart
from cachepoint.bench.kube.apiserver.schema import CustomResource
from cachepoint.bench.kube.apiserver.status import ApiError
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


def admitted(doc: dict[str, Any]) -> dict[str, Any]:
    """The CacheReplica as an API server stores it: schema, defaults and CEL rules."""
    served = [s for crd in chart.crds() for s in CustomResource.from_crd(crd)]
    (cache_replica,) = [s for s in served if s.kind == "CacheReplica"]
    return cache_replica.admit(doc, None)


def test_vllm_entries_take_the_host_tier_alone(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    replicas = cache_replicas(rendered[SCENARIO])
    vllm, lru = replicas["llama-8b-vllm"], replicas["llama-8b-vllm-lru"]
    # The disk defaults are kvcore's tier: left out for engine vllm, the host tier kept.
    assert vllm["spec"]["kv"] == {"hostBytes": "64Gi"}
    assert vllm["spec"]["image"].split("/")[-1].startswith("cachepoint-replica-vllm:")
    assert admitted(vllm)["spec"]["kv"]["hostBytes"] == "64Gi"
    assert admitted(lru)["spec"]["vllm"] == {"retention": False}

    pod = member_pod(vllm)
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CACHEPOINT_REPLICA_ENGINE"] == "vllm"
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(64 * GI)
    assert "CACHEPOINT_REPLICA_KV_DISK_BYTES" not in env
    assert "CACHEPOINT_REPLICA_VLLM_RETENTION" not in env  # the replica's default: on
    assert "kv-disk" not in {v["name"] for v in pod["spec"]["volumes"]}
    # vLLM's OffloadingConnector pins the host tier: 48Gi / 64Gi plus 64Gi.
    assert container["resources"]["requests"]["memory"] == "112Gi"
    assert container["resources"]["limits"]["memory"] == "128Gi"

    env = {e["name"]: e.get("value") for e in member_pod(lru)["spec"]["containers"][0]["env"]}
    assert env["CACHEPOINT_REPLICA_KV_HOST_BYTES"] == str(16 * GI)
    assert env["CACHEPOINT_REPLICA_VLLM_RETENTION"] == "false"


def test_a_cpu_vllm_entry_takes_no_host_tier_default(helm: str) -> None:
    """vLLM's CPU build has no offloading connector: the fleet's host tier default is
    not applied to it (set on the entry itself, the CRD refuses it)."""
    entry = (
        '{"name": "cpu-vllm", "engine": "vllm", "gpusPerPod": 0, "model": {"name": "m"}, '
        '"kv": {"blockSize": 32}}'
    )
    docs = render(helm, SCENARIO, "--set-json", f"replicas=[{entry}]")
    doc = cache_replicas(docs)["cpu-vllm"]
    assert doc["spec"]["kv"] == {"blockSize": 32}
    admitted(doc)
    check("cpu-vllm", doc["spec"])
    doc["spec"]["kv"]["hostBytes"] = "8Gi"
    with pytest.raises(ApiError, match="vLLM's CPU build") as refused:
        admitted(doc)
    assert refused.value.code == 422
