"""The CacheReplica spec as the operator reads it, and the checks beyond the schema.

The CRD's openAPIV3Schema is the source of truth for bounds and defaults; this model
repeats them so the operator behaves the same against an API server that did not
apply them (a unit test keeps the two in step). `spec_problems` is the admission
check: anything it reports becomes a Degraded condition and a PermanentError.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from cachepoint.operator.naming import MAX_NAME_LENGTH
from cachepoint.operator.sizes import parse_kv_size, parse_quantity

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class _Spec(BaseModel):
    # extra="ignore": a real API server prunes unknown fields; stay as lenient here.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class PvcSource(_Spec):
    claim_name: str = Field(min_length=1)
    sub_path: str | None = None


class HostPathSource(_Spec):
    path: str = Field(pattern=r"^/")


class SecretKey(_Spec):
    name: str = Field(min_length=1)
    key: str = Field("HF_TOKEN", min_length=1)


class EphemeralWeights(_Spec):
    # Per member: made with the pod, deleted with it (a cold download on every new pod).
    size: int | str
    storage_class_name: str | None = None


class WeightsStorage(_Spec):
    """Where a Hugging Face download lands; one of the two."""

    # An existing claim, shared by every member (ReadWriteMany, or one member only).
    claim_name: str | None = Field(None, min_length=1)
    ephemeral: EphemeralWeights | None = None


class HuggingFaceSource(_Spec):
    repo: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
    revision: str = Field("main", min_length=1)
    # A Secret in the CacheReplica's namespace with the Hub token (gated or private repos).
    token_secret: SecretKey | None = None
    storage: WeightsStorage


class ModelSpec(_Spec):
    name: str = Field(min_length=1, max_length=253)
    model_dir: str = Field("/models", pattern=r"^/")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None
    hugging_face: HuggingFaceSource | None = None
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=16)

    def sources(self) -> list[str]:
        given: list[tuple[str, _Spec | None]] = [
            ("pvc", self.pvc),
            ("hostPath", self.host_path),
            ("huggingFace", self.hugging_face),
        ]
        return [name for name, source in given if source is not None]

    @property
    def has_weights(self) -> bool:
        return bool(self.sources())


EvictionName = Literal["lru", "slru", "reuse_credit", "hit_density"]  # kvcore's registry


# A KV size as the replica reads it (8Gi, 8GiB, bytes), held as a byte count.
KVSize = Annotated[int, BeforeValidator(parse_kv_size)]
# NOTE: the replica images' group (docker/replica-*.Dockerfile): a fresh filesystem on a
# claim is root's, and the non-root replica must write its disk-tier files there.
REPLICA_GID = 10001
STORAGE = "ephemeral-storage"  # the node-disk resource an emptyDir is accounted to


class EmptyDirDisk(_Spec):
    # The volume's cap; default: diskBytes plus headroom for the filesystem (pod.py).
    size_limit: int | str | None = None


class HostPathDisk(_Spec):
    # A directory on the node (node-local NVMe), writable by the replica's user.
    path: str = Field(pattern=r"^/")
    # Directory: it must exist (prepared on the node); DirectoryOrCreate: kubelet makes it.
    type: Literal["Directory", "DirectoryOrCreate"] = "Directory"


class EphemeralDisk(_Spec):
    # A storage class that provisions node-local volumes (local-path, TopoLVM, ...).
    storage_class_name: str | None = None
    # The claim's size; default: diskBytes plus headroom for the filesystem (pod.py).
    size: int | str | None = None
    # Group the volume is made writable for (pod securityContext.fsGroup).
    fs_group: int = Field(REPLICA_GID, ge=0)


class DiskVolume(_Spec):
    """Where the disk tier's files live; at most one source. None of them: an emptyDir."""

    empty_dir: EmptyDirDisk | None = None
    host_path: HostPathDisk | None = None
    ephemeral: EphemeralDisk | None = None

    def sources(self) -> list[str]:
        given: list[tuple[str, _Spec | None]] = [
            ("emptyDir", self.empty_dir),
            ("hostPath", self.host_path),
            ("ephemeral", self.ephemeral),
        ]
        return [name for name, source in given if source is not None]

    @property
    def is_empty_dir(self) -> bool:
        return self.host_path is None and self.ephemeral is None


class KVSpec(_Spec):
    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, ge=0.01, le=1.0)
    retained_share: float = Field(0.5, ge=0.0, le=1.0)
    # Each org's share of the retained budget unless its org row says otherwise.
    org_retained_share: float = Field(0.5, ge=0.0, le=1.0)
    eviction: EvictionName | None = None  # None: the replica's own default
    min_cacheable_tokens: int = Field(1024, ge=0)
    cache_bytes: int | str | None = None
    # KV tiers behind the device pool, for the whole member (all TP ranks); 0 = off.
    # The host tier lives in the pod's RAM: pod.py adds it to the memory resources.
    # On engine vllm (GPUs only) the host tier is vLLM's OffloadingConnector; no disk tier.
    host_bytes: KVSize = 0
    # Where the disk tier's volume is mounted; used only when disk_bytes > 0.
    disk_path: str | None = Field(None, pattern=r"^/")
    disk_bytes: KVSize = 0
    disk_volume: DiskVolume | None = None

    @property
    def has_disk_tier(self) -> bool:
        return self.disk_bytes > 0


class BatchingSpec(_Spec):
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    # NOTE: at least 1: every request waits (at least for the next step) before it
    # runs, so a replica with no queue answered 429 to everything.
    max_waiting: int | None = Field(None, ge=1)


class RolloutSpec(_Spec):
    # Members down at once, counting those already not ready: bounds a roll and is the
    # PodDisruptionBudget's maxUnavailable for voluntary disruptions (node drains).
    max_unavailable: int = Field(1, ge=1, le=64)


class DrainSpec(_Spec):
    # How long a deleted member keeps serving its in-flight streams after it has told the
    # gateway to stop routing to it; the pod's termination grace adds a margin to this.
    grace_period_seconds: int = Field(300, ge=0, le=86400)


class StartupProbeSpec(_Spec):
    # NOTE: the default allows 15 minutes for the weights to load onto the GPUs. A
    # Hugging Face download runs before, in an init container, outside this budget;
    # a large checkpoint read from network storage may still need more.
    period_seconds: int = Field(10, ge=1, le=3600)
    failure_threshold: int = Field(90, ge=1, le=100000)


class VllmSpec(_Spec):
    """Settings of engine vllm alone (refused on torch, where they would mean nothing)."""

    # Cachepoint's retention connector pins managed entries' blocks in vLLM for their TTL
    # (retention guaranteed); off = vLLM's LRU decides (best effort).
    retention: bool = True


class ReplicaSpec(_Spec):
    replicas: int = Field(1, ge=0, le=64)
    # torch: Cachepoint's engine and kvcore's pool; vllm: vLLM's engine behind a kvcore
    # mirror (its own image, cachepoint-replica-vllm).
    engine: Literal["torch", "vllm"] = "torch"
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[dict[str, str]] = Field(default_factory=list)
    model: ModelSpec
    tensor_parallel_size: int = Field(1, ge=1, le=16)
    gpus_per_pod: int = Field(1, ge=0, le=16)
    kv: KVSpec = Field(default_factory=KVSpec)
    # None when not given: the replica's defaults (the API server sets no object here).
    vllm: VllmSpec | None = None
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    port: int = Field(8100, ge=1, le=65535)
    shm_size: int | str = "1Gi"
    resources: dict[str, dict[str, int | str]] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    priority_class_name: str | None = None
    env: list[dict[str, Any]] = Field(default_factory=list)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    drain: DrainSpec = Field(default_factory=DrainSpec)
    startup_probe: StartupProbeSpec = Field(default_factory=StartupProbeSpec)

    @property
    def vllm_retention(self) -> bool:
        return self.vllm is None or self.vllm.retention

    @property
    def max_unavailable(self) -> int:
        return self.rollout.max_unavailable

    @property
    def drain_grace_seconds(self) -> int:
        return self.drain.grace_period_seconds


class SpecError(ValueError):
    """A spec that can never run. Carries every problem found, for the condition message."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_spec(raw: Mapping[str, Any]) -> ReplicaSpec:
    try:
        return ReplicaSpec.model_validate(dict(raw))
    except ValidationError as e:
        problems = [
            f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        ]
        raise SpecError(problems) from None


def spec_problems(name: str, spec: ReplicaSpec) -> list[str]:
    """What the schema cannot express; an empty list means the spec can run."""
    problems: list[str] = []
    if len(name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(name):
        problems.append(
            f"name {name!r} must be a DNS label of at most {MAX_NAME_LENGTH} characters "
            "(member pods use it as their hostname)"
        )
    tp, gpus = spec.tensor_parallel_size, spec.gpus_per_pod
    # TP ranks are local processes in one pod, one GPU each; on CPU (0 GPUs) they share cores.
    if gpus > 0 and tp > gpus:
        problems.append(
            f"tensorParallelSize {tp} needs {tp} GPUs in one pod but gpusPerPod is {gpus}"
        )
    heads = {
        "numAttentionHeads": spec.model.num_attention_heads,
        "numKeyValueHeads": spec.model.num_key_value_heads,
    }
    for field, count in heads.items():
        if count is not None and count % tp:
            problems.append(f"tensorParallelSize {tp} does not divide model.{field} {count}")
    if len(spec.model.sources()) > 1:
        problems.append(
            "model.pvc, model.hostPath and model.huggingFace are exclusive: give one weights source"
        )
    problems += _hugging_face_problems(spec)
    problems += _tier_problems(spec)
    problems += _vllm_problems(spec)
    return problems


VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels take blocks in multiples of 32


def _vllm_problems(spec: ReplicaSpec) -> list[str]:
    if spec.engine != "vllm":
        if spec.vllm is not None:
            return [
                "vllm applies to engine vllm only (engine torch keeps retention in kvcore, "
                "without a connector): drop it or set engine: vllm"
            ]
        return []
    kv, problems = spec.kv, []
    if kv.disk_bytes:
        problems.append(
            "kv.diskBytes is kvcore's disk tier, which engine vllm does not have (its host "
            "tier is vLLM's OffloadingConnector: kv.hostBytes, on GPUs; docs/vllm.md)"
        )
    if kv.host_bytes and spec.gpus_per_pod == 0:
        problems.append(
            "kv.hostBytes with engine vllm is vLLM's OffloadingConnector, which runs on GPUs "
            "only: vLLM's CPU build (gpusPerPod 0) has no host tier"
        )
    if kv.eviction is not None:
        problems.append("kv.eviction is a kvcore policy; engine vllm evicts by vLLM's own LRU")
    if spec.gpus_per_pod == 0 and kv.block_size % VLLM_CPU_BLOCK_MULTIPLE:
        problems.append(
            f"engine vllm on the CPU (gpusPerPod 0) needs kv.blockSize in multiples of "
            f"{VLLM_CPU_BLOCK_MULTIPLE} (vLLM's CPU attention); give the gateway the same"
        )
    return problems


def _hugging_face_problems(spec: ReplicaSpec) -> list[str]:
    source = spec.model.hugging_face
    if source is None:
        return []
    storage, problems = source.storage, []
    if (storage.claim_name is None) == (storage.ephemeral is None):
        problems.append(
            "model.huggingFace.storage: give one of claimName (a shared claim) and "
            "ephemeral (a claim per member)"
        )
    if storage.ephemeral is not None:
        try:
            if parse_quantity(storage.ephemeral.size) <= 0:
                problems.append("model.huggingFace.storage.ephemeral.size must be above 0")
        except ValueError as e:
            problems.append(f"model.huggingFace.storage.ephemeral.size: {e}")
    return problems


def _nested(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _tier_problems(spec: ReplicaSpec) -> list[str]:
    kv, problems = spec.kv, []
    if kv.disk_bytes > 0:
        if kv.disk_path is None:
            problems.append("kv.diskBytes needs kv.diskPath: where the disk tier is mounted")
        elif _nested(kv.disk_path, "/dev/shm") or _nested(kv.disk_path, spec.model.model_dir):
            problems.append(
                f"kv.diskPath {kv.disk_path} overlaps /dev/shm or model.modelDir: "
                "give the disk tier its own directory"
            )
        if kv.host_bytes == 0:
            problems.append(
                "kv.diskBytes needs kv.hostBytes > 0: the disk tier sits behind the host tier"
            )
    if kv.disk_volume is not None and len(kv.disk_volume.sources()) > 1:
        problems.append(
            "kv.diskVolume: emptyDir, hostPath and ephemeral are exclusive: give one source"
        )
    quantities: list[tuple[str, int | str | None]] = []
    if kv.host_bytes > 0:
        quantities += [
            (f"resources.{kind}.memory", spec.resources.get(kind, {}).get("memory"))
            for kind in ("requests", "limits")
        ]
    volume = kv.disk_volume or DiskVolume()
    if kv.has_disk_tier:
        if volume.empty_dir is not None:
            quantities.append(("kv.diskVolume.emptyDir.sizeLimit", volume.empty_dir.size_limit))
        if volume.ephemeral is not None:
            quantities.append(("kv.diskVolume.ephemeral.size", volume.ephemeral.size))
        if volume.is_empty_dir:  # pod.py adds it to the pod's ephemeral storage
            quantities += [
                (f"resources.{kind}.ephemeral-storage", spec.resources.get(kind, {}).get(STORAGE))
                for kind in ("requests", "limits")
            ]
    volume_sizes = ("kv.diskVolume.emptyDir.sizeLimit", "kv.diskVolume.ephemeral.size")
    for where, value in quantities:
        if value is None:
            continue
        try:
            size = parse_quantity(value)
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        if where in volume_sizes and size < kv.disk_bytes:
            # An emptyDir past its limit gets the pod evicted; a full claim fails writes.
            problems.append(f"{where} {value} is smaller than kv.diskBytes ({kv.disk_bytes} B)")
    return problems


def check(name: str, raw: Mapping[str, Any]) -> ReplicaSpec:
    """Parse and check a spec; raise SpecError listing everything wrong with it."""
    spec = parse_spec(raw)
    problems = spec_problems(name, spec)
    if problems:
        raise SpecError(problems)
    return spec
