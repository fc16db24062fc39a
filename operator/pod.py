"""Pure builders for one member pod: one replica process with all its TP ranks.

Nothing here talks to the API; the handlers adopt (owner reference, namespace) and
send what these return. The same inputs always give the same dict.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.naming import (
    ANNOTATION_MIN_CACHEABLE,
    ANNOTATION_TEMPLATE_HASH,
    CONTAINER,
    INTERNAL_TOKEN_KEY,
    LABEL_MEMBER,
    PORT_NAME,
    common_labels,
    credentials_secret_name,
    member_pod_name,
    replica_process_name,
    service_name,
)
from cachepoint.operator.sizes import add_quantity, format_quantity, parse_quantity
from cachepoint.operator.spec import REPLICA_GID, STORAGE, ReplicaSpec

GPU_RESOURCE = "nvidia.com/gpu"
ENV_PREFIX = "CACHEPOINT_REPLICA_"
DISK_VOLUME = "kv-disk"
MODEL_VOLUME = "model"
FETCH_CONTAINER = "fetch-weights"
MIB = 2**20
# NOTE: kubelet counts terminationGracePeriodSeconds from the start of preStop, and the
# drain hook may use all of drain.gracePeriodSeconds: this is what is left after it for
# SIGTERM (uvicorn's shutdown, the NATS flush, the TP ranks exiting) before SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 30
# The identity the template is rendered for when hashing it: a fixed one, so that the
# hash depends on the spec and the operator alone (every member, and every caller that
# has no pod name, gets the same one).
_TEMPLATE_REPLICA = _TEMPLATE_NAMESPACE = "template"


def template_hash(spec: ReplicaSpec, config: OperatorConfig) -> str:
    """Fingerprint of the member pod the builders render now; a change means a roll.

    NOTE: the rendered pod, not the spec, so that any change to what the builders make
    of a spec (a new probe, hook or env var in a new operator version) rolls the
    members. Upgrading the operator therefore rolls them once whenever it renders
    different pods. The per-member identity (name, hostname, member label and the
    names in env) comes from a fixed placeholder member, so all members share the hash.
    """
    pod = _render_pod(
        replica=_TEMPLATE_REPLICA, namespace=_TEMPLATE_NAMESPACE, index=0, spec=spec, config=config
    )
    return hash_pod_template(pod, config)


def hash_pod_template(pod: dict[str, Any], config: OperatorConfig) -> str:
    """The hash of a rendered pod, leaving out what differs between members."""
    template = json.loads(json.dumps(pod))  # a deep copy we may strip
    metadata = template.get("metadata", {})
    metadata.pop("name", None)
    metadata.get("annotations", {}).pop(ANNOTATION_TEMPLATE_HASH, None)
    metadata.get("labels", {}).pop(LABEL_MEMBER, None)
    template.get("spec", {}).pop("hostname", None)
    # NOTE: the pod holds the internal token only by reference (a secretKeyRef, read at
    # container start), so a new token is invisible in it: its digest is hashed along.
    payload = {"pod": template, "token": config.token_digest()}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _field_ref(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_ref(replica: str, key: str) -> dict[str, Any]:
    return {"valueFrom": {"secretKeyRef": {"name": credentials_secret_name(replica), "key": key}}}


def member_url(*, replica: str, namespace: str, pod: str, port: int) -> str:
    """The member's stable DNS name (hostname + subdomain + the headless Service).

    The gateway accepts a heartbeat's URL only in this shape and only for the replica
    named <namespace>_<pod>, so an announced URL cannot point anywhere else.
    """
    return f"http://{pod}.{service_name(replica)}.{namespace}.svc.cluster.local:{port}"


def build_replica_env(
    *, replica: str, namespace: str, pod: str, spec: ReplicaSpec, config: OperatorConfig
) -> list[dict[str, Any]]:
    """The replica's settings as CACHEPOINT_REPLICA_* env, plus NATS, OTLP and pod identity."""
    settings: dict[str, Any] = {
        "NAME": replica_process_name(namespace, pod),
        "ENGINE": spec.engine,
        "HOST": "0.0.0.0",  # reached through the pod IP by probes, the operator and the gateway
        "PORT": spec.port,
        "MODEL_NAME": spec.model.name,
        # Without a weights source the replica runs its small random model (dev clusters).
        "MODEL_DIR": spec.model.model_dir if spec.model.has_weights else None,
        "TENSOR_PARALLEL_SIZE": spec.tensor_parallel_size,
        "DEVICE": "cuda" if spec.gpus_per_pod > 0 else "cpu",
        "DTYPE": spec.model.dtype,
        "BLOCK_SIZE": spec.kv.block_size,
        "GPU_MEMORY_UTILIZATION": spec.kv.gpu_memory_utilization,
        "RETAINED_SHARE": spec.kv.retained_share,
        "ORG_RETAINED_SHARE": spec.kv.org_retained_share,
        "EVICTION": spec.kv.eviction,
        "KV_CACHE_BYTES": spec.kv.cache_bytes,
        "MAX_MODEL_LEN": spec.model.max_model_len,
        "MAX_NUM_SEQS": spec.batching.max_num_seqs,
        "MAX_NUM_BATCHED_TOKENS": spec.batching.max_num_batched_tokens,
        "MAX_WAITING": spec.batching.max_waiting,
        # Byte counts, not the spec's text: the replica and Kubernetes read "G" differently.
        "KV_HOST_BYTES": spec.kv.host_bytes or None,
        "KV_DISK_PATH": spec.kv.disk_path if spec.kv.has_disk_tier else None,
        "KV_DISK_BYTES": spec.kv.disk_bytes or None,
        # Only when off: the replica's default is on, and an unset field rolls nothing.
        "VLLM_RETENTION": "false" if spec.engine == "vllm" and not spec.vllm_retention else None,
    }
    env = [
        {"name": ENV_PREFIX + key, "value": str(value)}
        for key, value in settings.items()
        if value is not None
    ]
    if config.nats_url:
        env.append({"name": "CACHEPOINT_NATS_URL", "value": config.nats_url})
        # Its own NATS user: the server lets it publish only under this name.
        env.append({"name": "CACHEPOINT_NATS_USER", "value": replica_process_name(namespace, pod)})
        env.append({"name": "CACHEPOINT_NATS_PASSWORD", **_secret_ref(replica, pod)})
    if config.internal_token is not None:
        env.append(
            {"name": "CACHEPOINT_INTERNAL_TOKEN", **_secret_ref(replica, INTERNAL_TOKEN_KEY)}
        )
    if config.otlp_endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": config.otlp_endpoint})
    attributes = {
        "service.instance.id": replica_process_name(namespace, pod),
        "k8s.namespace.name": namespace,
        "k8s.pod.name": pod,
        "cachepoint.replica_group": replica,
    }
    env += [
        {"name": "OTEL_SERVICE_NAME", "value": "cachepoint-replica"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": ",".join(f"{k}={v}" for k, v in attributes.items()),
        },
        # The pod's own address, for a replica that must advertise where it can be reached.
        {"name": "POD_NAME", **_field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **_field_ref("metadata.namespace")},
        {"name": "POD_IP", **_field_ref("status.podIP")},
        # What the replica puts in its heartbeats: its DNS name, not its IP, so that the
        # gateway can check the URL against the name (see member_url).
        {
            "name": ENV_PREFIX + "ADVERTISE_URL",
            "value": member_url(replica=replica, namespace=namespace, pod=pod, port=spec.port),
        },
    ]
    # User env comes last and wins over ours with the same name (one entry per name).
    overridden = {item["name"] for item in spec.env}
    return [item for item in env if item["name"] not in overridden] + [dict(e) for e in spec.env]


def _add_resource(resources: dict[str, dict[str, int | str]], name: str, extra: int) -> None:
    """Raise resource `name` by `extra` bytes: its limit if set, its request if set, and a
    request of `extra` when neither is (an unset request with a limit is the limit)."""
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    if name in limits:
        limits[name] = add_quantity(limits[name], extra)
    if name in requests:
        requests[name] = add_quantity(requests[name], extra)
    elif name not in limits:
        resources.setdefault("requests", {})[name] = format_quantity(extra)


def disk_volume_size(spec: ReplicaSpec) -> int:
    """Bytes to give the disk tier's volume: diskBytes plus room for the filesystem.

    An emptyDir over its sizeLimit gets the pod evicted, and a fresh filesystem on a
    claim keeps a share for its metadata and for root: the replica's files alone must
    never fill the volume. Rounded up to whole MiB.
    """
    volume = spec.kv.disk_volume
    if volume is not None and volume.empty_dir is not None and volume.empty_dir.size_limit:
        return parse_quantity(volume.empty_dir.size_limit)
    if volume is not None and volume.ephemeral is not None:
        if volume.ephemeral.size:
            return parse_quantity(volume.ephemeral.size)
        headroom = spec.kv.disk_bytes // 8  # ext4 reserves 5% for root, plus metadata
    else:
        headroom = spec.kv.disk_bytes // 32  # directory blocks, partial-page rounding
    size = spec.kv.disk_bytes + headroom + 64 * MIB
    return -(-size // MIB) * MIB


def build_resources(spec: ReplicaSpec) -> dict[str, dict[str, int | str]]:
    resources = {kind: dict(values) for kind, values in spec.resources.items() if values}
    if spec.kv.host_bytes > 0:
        # NOTE: the host tier lives in the pod's RAM (pinned memory on GPUs counts
        # against the container's cgroup): without this a full host tier would get the
        # member OOM-killed, or it would be scheduled onto a node without the memory.
        # Either engine: on vllm it is vLLM's OffloadingConnector, pinned buffers of
        # that size allocated at start.
        _add_resource(resources, "memory", spec.kv.host_bytes)
    volume = spec.kv.disk_volume
    if spec.kv.has_disk_tier and (volume is None or volume.is_empty_dir):
        # An emptyDir on the node's disk is accounted as the pod's ephemeral storage:
        # request it, so the pod lands on a node with room for the disk tier.
        _add_resource(resources, STORAGE, disk_volume_size(spec))
    if spec.gpus_per_pod > 0:
        # Extended resources cannot overcommit: the request must equal the limit.
        gpus = str(spec.gpus_per_pod)
        resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
        resources.setdefault("requests", {})[GPU_RESOURCE] = gpus
    return resources


def build_model_volume(spec: ReplicaSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) for the weights, or None when the spec names no source.

    The replica always mounts them read-only; a Hugging Face download writes them
    first, from the init container (build_fetch_container).
    """
    model = spec.model
    mount: dict[str, Any] = {"name": MODEL_VOLUME, "mountPath": model.model_dir, "readOnly": True}
    if model.pvc is not None:
        volume = {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": model.pvc.claim_name, "readOnly": True},
        }
        if model.pvc.sub_path:
            mount["subPath"] = model.pvc.sub_path
        return volume, mount
    if model.host_path is not None:
        volume = {
            "name": MODEL_VOLUME,
            "hostPath": {"path": model.host_path.path, "type": "Directory"},
        }
        return volume, mount
    if model.hugging_face is not None:
        storage = model.hugging_face.storage
        if storage.ephemeral is not None:
            claim: dict[str, Any] = {
                # NOTE: a claim per member: block storage (EBS gp3, PD, Azure Disk) is
                # ReadWriteOnce, so members on different nodes cannot share one.
                "accessModes": ["ReadWriteOnce"],
                "resources": {
                    "requests": {"storage": format_quantity(parse_quantity(storage.ephemeral.size))}
                },
            }
            if storage.ephemeral.storage_class_name:
                claim["storageClassName"] = storage.ephemeral.storage_class_name
            volume = {
                "name": MODEL_VOLUME,
                "ephemeral": {
                    "volumeClaimTemplate": {
                        "metadata": {"labels": {"cachepoint.dev/volume": MODEL_VOLUME}},
                        "spec": claim,
                    }
                },
            }
        else:
            volume = {
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": storage.claim_name},
            }
        return volume, mount
    return None


# Where the Hub is and how to reach it (a mirror, a proxy): taken from the user's env.
_FETCH_ENV = ("HF_ENDPOINT", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY")


def build_fetch_container(spec: ReplicaSpec) -> dict[str, Any] | None:
    """The init container that downloads Hugging Face weights into the model volume.

    Idempotent (cachepoint.replica.weights_fetch keeps a completion marker), so a
    restarted pod, or a member on a claim another one already filled, starts at once.
    """
    source = spec.model.hugging_face
    if source is None:
        return None
    dest = spec.model.model_dir
    env: list[dict[str, Any]] = [
        # NOTE: the image's home may not exist for the replica's uid: keep the hub's
        # own files (token cache, xet chunks) in the scratch volume below.
        {"name": "HF_HOME", "value": "/tmp/hf-home"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if source.token_secret is not None:
        ref = {"name": source.token_secret.name, "key": source.token_secret.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    # Where the Hub lives (a mirror, a proxy) comes from the user's env, as for the replica.
    env += [dict(e) for e in spec.env if e.get("name") in _FETCH_ENV]
    return {
        "name": FETCH_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": [
            "python",
            "-m",
            "cachepoint.replica.weights_fetch",
            "--repo",
            source.repo,
            "--revision",
            source.revision,
            "--dest",
            dest,
        ],
        "env": env,
        # Downloads stream to disk: little CPU or memory, whatever the model's size.
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"memory": "2Gi"},
        },
        "volumeMounts": [
            {"name": MODEL_VOLUME, "mountPath": dest},
            {"name": "fetch-tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def build_disk_volume(spec: ReplicaSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) for the disk tier at kv.diskPath, or None without one."""
    kv = spec.kv
    if not kv.has_disk_tier or kv.disk_path is None:
        return None
    mount: dict[str, Any] = {"name": DISK_VOLUME, "mountPath": kv.disk_path}
    source = kv.disk_volume
    size = format_quantity(disk_volume_size(spec))
    volume: dict[str, Any] = {"name": DISK_VOLUME}
    if source is not None and source.host_path is not None:
        volume["hostPath"] = {"path": source.host_path.path, "type": source.host_path.type}
        # NOTE: one directory per member: two members scheduled onto the same node must
        # not share files. kubelet makes it with the node directory's mode.
        mount["subPathExpr"] = "$(POD_NAME)"
    elif source is not None and source.ephemeral is not None:
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": size}},
        }
        if source.ephemeral.storage_class_name:
            claim["storageClassName"] = source.ephemeral.storage_class_name
        # A generic ephemeral volume: made with the pod, deleted with it, node-local when
        # the storage class is.
        volume["ephemeral"] = {
            "volumeClaimTemplate": {
                "metadata": {"labels": {"cachepoint.dev/volume": DISK_VOLUME}},
                "spec": claim,
            }
        }
    else:
        volume["emptyDir"] = {"sizeLimit": size}
    return volume, mount


def build_probes(spec: ReplicaSpec, port_name: str = PORT_NAME) -> dict[str, dict[str, Any]]:
    startup = spec.startup_probe
    return {
        # Loading weights onto the GPUs can take minutes: the startup probe holds off
        # liveness until /healthz first answers (15 minutes by default).
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": port_name},
            "periodSeconds": startup.period_seconds,
            "failureThreshold": startup.failure_threshold,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": port_name},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": port_name},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
    }


def build_lifecycle(spec: ReplicaSpec) -> dict[str, Any]:
    """The preStop hook: drain before kubelet sends SIGTERM.

    cachepoint.replica.prestop tells the replica to announce draining on NATS (the
    gateway stops routing new requests to it at once) and waits for its in-flight
    streams, up to the drain grace; it reads the port and token from the pod's env.
    """
    command = ["python", "-m", "cachepoint.replica.prestop"]
    command += ["--timeout", str(spec.drain_grace_seconds)]
    return {"preStop": {"exec": {"command": command}}}


def termination_grace_seconds(spec: ReplicaSpec) -> int:
    return spec.drain_grace_seconds + SHUTDOWN_MARGIN_SECONDS


def build_replica_pod(
    *, replica: str, namespace: str, index: int, spec: ReplicaSpec, config: OperatorConfig
) -> dict[str, Any]:
    """Member `index` of CacheReplica `replica`: a bare pod the operator owns and replaces."""
    pod = _render_pod(replica=replica, namespace=namespace, index=index, spec=spec, config=config)
    pod["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] = template_hash(spec, config)
    return pod


def _render_pod(
    *, replica: str, namespace: str, index: int, spec: ReplicaSpec, config: OperatorConfig
) -> dict[str, Any]:
    """The member pod without its template hash (which is computed from this)."""
    name = member_pod_name(replica, index)
    volumes: list[dict[str, Any]] = [
        # NCCL and torch.distributed exchange through /dev/shm; the runtime's default 64MiB
        # is too small once there is more than one rank.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.shm_size)}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    model_volume = build_model_volume(spec)
    if model_volume is not None:
        volumes.append(model_volume[0])
        mounts.append(model_volume[1])
    disk_volume = build_disk_volume(spec)
    if disk_volume is not None:
        volumes.append(disk_volume[0])
        mounts.append(disk_volume[1])

    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["cachepoint-replica"],
        "ports": [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        "env": build_replica_env(
            replica=replica, namespace=namespace, pod=name, spec=spec, config=config
        ),
        "resources": build_resources(spec),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        **build_probes(spec),
        "lifecycle": build_lifecycle(spec),
    }
    pod_spec: dict[str, Any] = {
        # hostname + subdomain + the headless Service give each member a stable DNS name:
        # <pod>.<service>.<namespace>.svc, which survives the pod being replaced.
        "hostname": name,
        "subdomain": service_name(replica),
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    fetch = build_fetch_container(spec)
    if fetch is not None:
        pod_spec["initContainers"] = [fetch]
        volumes.append({"name": "fetch-tmp", "emptyDir": {}})
        # NOTE: a fresh claim's filesystem is root's; the non-root fetcher must write it.
        pod_spec["securityContext"]["fsGroup"] = REPLICA_GID
        pod_spec["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
    ephemeral = spec.kv.disk_volume.ephemeral if spec.kv.disk_volume else None
    if spec.kv.has_disk_tier and ephemeral is not None:
        pod_spec["securityContext"]["fsGroup"] = ephemeral.fs_group
        pod_spec["securityContext"]["fsGroupChangePolicy"] = "OnRootMismatch"
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in spec.image_pull_secrets]

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**common_labels(replica), LABEL_MEMBER: str(index)},
            "annotations": {
                # The replica has no setting for it: the gateway applies the minimum.
                # Recorded here so `kubectl describe` shows what this group was declared with.
                ANNOTATION_MIN_CACHEABLE: str(spec.kv.min_cacheable_tokens),
            },
        },
        "spec": pod_spec,
    }
