"""The pure manifest builders: deterministic, labelled, valid Kubernetes objects."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import SecretStr

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.nats_auth import (
    MemberCredentials,
    build_credentials_secret,
    build_users_conf,
    build_users_data,
    decode_secret,
    flatten,
    member_passwords,
    merge_record,
    new_password,
    parse_record,
)
from cachepoint.operator.pod import build_replica_pod, template_hash
from cachepoint.operator.service import build_replica_service, service_drift
from cachepoint.operator.spec import ReplicaSpec, parse_spec

K8S_VERSION = "1.31"
CONFIG = OperatorConfig(nats_url="nats://nats:4222", otlp_endpoint="http://otel:4317")


def make_spec(**overrides: Any) -> ReplicaSpec:
    return parse_spec({"image": "replica:1", "model": {"name": "llama"}, **overrides})


def pod(spec: ReplicaSpec, index: int = 0, config: OperatorConfig = CONFIG) -> dict[str, Any]:
    return build_replica_pod(
        replica="llama", namespace="serving", index=index, spec=spec, config=config
    )


def env_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom"))
        for e in manifest["spec"]["containers"][0]["env"]
    }


def test_same_inputs_same_manifest() -> None:
    assert pod(make_spec()) == pod(make_spec())
    spec = make_spec()
    assert build_replica_service(replica="llama", namespace="serving", spec=spec) == (
        build_replica_service(replica="llama", namespace="serving", spec=spec)
    )


def test_members_differ_only_in_identity() -> None:
    first, second = pod(make_spec(), 0), pod(make_spec(), 1)
    assert (first["metadata"]["name"], second["metadata"]["name"]) == ("llama-0", "llama-1")
    assert second["spec"]["hostname"] == "llama-1"
    assert second["metadata"]["labels"]["cachepoint.dev/member"] == "1"
    assert env_of(second)["CACHEPOINT_REPLICA_NAME"] == "serving_llama-1"
    assert first["spec"]["containers"][0]["image"] == second["spec"]["containers"][0]["image"]


def test_template_hash_follows_the_pod_template_not_the_count() -> None:
    base = template_hash(make_spec(), CONFIG)
    assert template_hash(make_spec(replicas=5), CONFIG) == base
    assert template_hash(make_spec(image="replica:2"), CONFIG) != base
    assert template_hash(make_spec(kv={"blockSize": 32}), CONFIG) != base
    assert template_hash(make_spec(), OperatorConfig(nats_url="nats://other:4222")) != base
    assert pod(make_spec())["metadata"]["annotations"]["cachepoint.dev/template-hash"] == base


def test_labels_select_the_members() -> None:
    manifest = pod(make_spec())
    labels = manifest["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "cachepoint-replica"
    assert labels["app.kubernetes.io/instance"] == "llama"
    assert labels["app.kubernetes.io/managed-by"] == "cachepoint-operator"
    service = build_replica_service(replica="llama", namespace="serving", spec=make_spec())
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["clusterIP"] == "None"
    assert manifest["spec"]["subdomain"] == service["metadata"]["name"]


def test_gpus_are_requested_and_limited_alike() -> None:
    resources = pod(
        make_spec(gpusPerPod=4, tensorParallelSize=4, resources={"limits": {"memory": "64Gi"}})
    )["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "4"}
    assert resources["requests"] == {"nvidia.com/gpu": "4"}
    cpu = pod(make_spec(gpusPerPod=0))
    assert "nvidia.com/gpu" not in str(cpu["spec"]["containers"][0]["resources"])
    assert env_of(cpu)["CACHEPOINT_REPLICA_DEVICE"] == "cpu"


def test_env_carries_the_replica_settings_nats_and_otlp() -> None:
    kv = {"blockSize": 32, "orgRetainedShare": 0.25}
    env = env_of(pod(make_spec(tensorParallelSize=2, gpusPerPod=2, kv=kv)))
    assert env["CACHEPOINT_REPLICA_TENSOR_PARALLEL_SIZE"] == "2"
    assert env["CACHEPOINT_REPLICA_ORG_RETAINED_SHARE"] == "0.25"
    assert env["CACHEPOINT_REPLICA_BLOCK_SIZE"] == "32"
    assert env["CACHEPOINT_REPLICA_GPU_MEMORY_UTILIZATION"] == "0.9"
    assert env["CACHEPOINT_REPLICA_HOST"] == "0.0.0.0"
    assert env["CACHEPOINT_REPLICA_PORT"] == "8100"
    assert env["CACHEPOINT_NATS_URL"] == "nats://nats:4222"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4317"
    assert env["OTEL_SERVICE_NAME"] == "cachepoint-replica"
    assert "k8s.pod.name=llama-0" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Unset optional settings are left to the replica's own defaults.
    assert "CACHEPOINT_REPLICA_MAX_MODEL_LEN" not in env
    assert "CACHEPOINT_REPLICA_EVICTION" not in env  # unset: the replica's default
    chosen = env_of(pod(make_spec(kv={"eviction": "lru"})))
    assert chosen["CACHEPOINT_REPLICA_EVICTION"] == "lru"
    assert "CACHEPOINT_REPLICA_MODEL_DIR" not in env  # no weights source: the random model
    assert "CACHEPOINT_NATS_URL" not in env_of(pod(make_spec(), config=OperatorConfig()))


def test_the_engine_reaches_the_replica_and_its_settings_accept_it() -> None:
    from cachepoint.replica.settings import ReplicaSettings

    assert env_of(pod(make_spec()))["CACHEPOINT_REPLICA_ENGINE"] == "torch"
    spec = make_spec(engine="vllm", gpusPerPod=1, kv={"blockSize": 16})
    env = env_of(pod(spec))
    assert env["CACHEPOINT_REPLICA_ENGINE"] == "vllm"
    # What the operator writes is what the replica reads: plain values, none refused.
    plain = {
        k.removeprefix("CACHEPOINT_REPLICA_").lower(): v
        for k, v in env.items()
        if k.startswith("CACHEPOINT_REPLICA_") and isinstance(v, str)
    }
    plain.pop("model_dir", None)  # no checkpoint on this machine
    assert ReplicaSettings(**plain).engine == "vllm"


def test_user_env_wins_once() -> None:
    manifest = pod(make_spec(env=[{"name": "CACHEPOINT_REPLICA_MAX_WAITING", "value": "9"}]))
    names = [e["name"] for e in manifest["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))
    assert env_of(manifest)["CACHEPOINT_REPLICA_MAX_WAITING"] == "9"


def test_model_volume_from_a_pvc_or_a_host_path() -> None:
    spec = make_spec(
        model={"name": "m", "modelDir": "/w", "pvc": {"claimName": "weights", "subPath": "llama"}}
    )
    manifest = pod(spec)
    volume = next(v for v in manifest["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mount = next(
        m for m in manifest["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model"
    )
    assert mount == {"name": "model", "mountPath": "/w", "readOnly": True, "subPath": "llama"}
    assert env_of(manifest)["CACHEPOINT_REPLICA_MODEL_DIR"] == "/w"
    host = pod(make_spec(model={"name": "m", "hostPath": {"path": "/data/llama"}}))
    volume = next(v for v in host["spec"]["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/data/llama", "type": "Directory"}


def test_probes_hit_the_replica_endpoints() -> None:
    container = pod(make_spec())["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"}]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "gpusPerPod": 8,
            "tensorParallelSize": 8,
            "model": {"name": "m", "pvc": {"claimName": "w"}, "dtype": "bfloat16"},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "priorityClassName": "serving",
            "imagePullSecrets": [{"name": "registry"}],
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
            "env": [
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
            ],
            "kv": {"cacheBytes": "2GiB"},
        },
    ],
    ids=["minimal", "everything"],
)
def test_manifests_are_valid_kubernetes_objects(overrides: dict[str, Any]) -> None:
    spec = make_spec(**overrides)
    kubernetes_validate.validate(pod(spec), K8S_VERSION, strict=True)
    service = build_replica_service(replica="llama", namespace="serving", spec=spec)
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def test_service_drift_replaces_only_what_changed() -> None:
    current = build_replica_service(replica="llama", namespace="serving", spec=make_spec())
    assert service_drift(current, current) == []
    desired = build_replica_service(replica="llama", namespace="serving", spec=make_spec(port=9000))
    (op,) = service_drift(current, desired)
    assert op["op"] == "replace"
    assert op["path"] == "/spec/ports"
    assert op["value"][0]["port"] == 9000


# ------------------------------------------------------------ event-plane credentials

SECURE = OperatorConfig(
    nats_url="nats://n.cp.svc.cluster.local:4222", internal_token="s3cr3t-t0k3n"
)


def test_members_get_their_nats_user_and_secrets_by_reference() -> None:
    env = env_of(pod(make_spec(port=9000), index=1, config=SECURE))
    assert env["CACHEPOINT_NATS_USER"] == "serving_llama-1"  # = CACHEPOINT_REPLICA_NAME
    assert env["CACHEPOINT_NATS_USER"] == env["CACHEPOINT_REPLICA_NAME"]
    assert env["CACHEPOINT_NATS_PASSWORD"] == {
        "secretKeyRef": {"name": "llama-credentials", "key": "llama-1"}
    }
    assert env["CACHEPOINT_INTERNAL_TOKEN"] == {
        "secretKeyRef": {"name": "llama-credentials", "key": "internal-token"}
    }
    # The URL the gateway's k8s-dns rule accepts for the name serving_llama-1.
    assert (
        env["CACHEPOINT_REPLICA_ADVERTISE_URL"]
        == "http://llama-1.llama.serving.svc.cluster.local:9000"
    )
    assert "s3cr3t-t0k3n" not in str(pod(make_spec(), config=SECURE))  # never inline
    bare = env_of(pod(make_spec(), config=OperatorConfig()))
    assert not {"CACHEPOINT_NATS_USER", "CACHEPOINT_INTERNAL_TOKEN"} & set(bare)


def test_a_new_internal_token_rolls_the_members() -> None:
    base = template_hash(make_spec(), SECURE)
    other = SECURE.model_copy(update={"internal_token": SecretStr("other")})
    assert template_hash(make_spec(), other) != base
    assert "s3cr3t-t0k3n" not in str(SECURE.token_digest())


def test_member_passwords_are_kept_made_and_dropped() -> None:
    made = iter(f"generated-password-{i:04d}" for i in range(10))
    existing = {"llama-0": "kept-password-000000", "llama-5": "gone-password-0000000"}
    passwords = member_passwords("llama", 3, existing, lambda: next(made))
    assert passwords == {
        "llama-0": "kept-password-000000",
        "llama-1": "generated-password-0000",
        "llama-2": "generated-password-0001",
    }
    # A value the users file could not hold (a hand edit) is replaced, not copied.
    fixed = member_passwords("llama", 1, {"llama-0": 'bad"pw'}, lambda: "fresh-password-00000")
    assert fixed == {"llama-0": "fresh-password-00000"}
    assert len(new_password()) >= 32


def test_credentials_secret_is_a_valid_object() -> None:
    credentials = MemberCredentials(passwords={"llama-0": "p" * 20}, internal_token="s3cr3t-t0k3n")
    secret = build_credentials_secret(replica="llama", namespace="serving", credentials=credentials)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert decode_secret(secret) == {"llama-0": "p" * 20, "internal-token": "s3cr3t-t0k3n"}
    assert secret["metadata"]["name"] == "llama-credentials"


def test_users_conf_is_sorted_deterministic_and_scoped_per_user() -> None:
    users = {"serving_b-0": "b" * 20, "serving_a-0": "a" * 20}
    conf = build_users_conf(users)
    assert conf == build_users_conf(dict(reversed(users.items())))
    lines = [line for line in conf.splitlines() if line.startswith("  {")]
    assert [line.split('"')[1] for line in lines] == ["gateway", "serving_a-0", "serving_b-0"]
    assert "password: $CACHEPOINT_NATS_GATEWAY_PASSWORD," in lines[0]
    assert (
        '{"publish": {"allow": ["cachepoint.kv.serving_a-0", '
        '"cachepoint.replica.heartbeat.serving_a-0"]}, '
        '"subscribe": {"allow": ["cachepoint.kv.snapshot.serving_a-0"]}, '
        '"allow_responses": true}' in lines[1]
    )
    bad = [
        ({"a b": "p" * 20}, "not a subject token"),
        ({"gateway": "p" * 20}, "cannot be named"),
        ({"ok": 'quote"inside-password'}, "cannot hold"),
    ]
    for users, message in bad:
        with pytest.raises(ValueError, match=message):
            build_users_conf(users)


def test_users_record_merges_one_cache_replica_at_a_time() -> None:
    record = merge_record({}, "serving/a", {"serving_a-0": "x" * 20})
    record = merge_record(record, "ml/b", {"ml-b-0": "y" * 20})
    assert set(flatten(record)) == {"serving_a-0", "ml-b-0"}
    assert merge_record(record, "serving/a", None) == {"ml/b": {"ml-b-0": "y" * 20}}
    data = decode_secret({"data": build_users_data(record)})
    assert parse_record(data["members.json"]) == record
    assert build_users_conf(flatten(record)) == data["users.conf"]
    assert parse_record("not json") == parse_record("[1]") == {}


def test_the_advertised_url_passes_the_gateways_k8s_dns_rule() -> None:
    # A contract test across components (the operator itself imports no gateway code):
    # what a member announces is what the chart's gateway (k8s-dns) accepts for it.
    from cachepoint.gateway.fleet.trust import UrlPolicy

    policy = UrlPolicy(mode="k8s-dns")
    env = env_of(pod(make_spec(), index=2, config=SECURE))
    name, url = env["CACHEPOINT_REPLICA_NAME"], env["CACHEPOINT_REPLICA_ADVERTISE_URL"]
    assert policy.refuses(name, url) is None
    assert policy.refuses("serving_llama-1", url) is not None  # not another member's
