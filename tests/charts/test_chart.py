"""The Helm chart: lint, render every scenario, validate every object, check conventions."""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cachepoint.bench.kube.apiserver.schema import CustomResource
from cachepoint.operator.spec import check

from .conftest import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    render,
    run_helm,
    values_args,
)

CRD_FILE = CHART / "crds" / "cachereplicas.cachepoint.dev.yaml"
FULLNAME = f"{RELEASE}-cachepoint"
# templates/<kind>-<component>.yaml: the file prefix for each kind.
FILE_PREFIX = {"HorizontalPodAutoscaler": "hpa", "PodDisruptionBudget": "pdb"}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint(helm: str, scenario: str) -> None:
    run_helm(
        helm,
        "lint",
        "--strict",
        "--quiet",
        "--kube-version",
        KUBE_VERSION,
        CHART,
        *values_args(scenario),
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_built_in_objects_are_valid_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    # CacheReplica and kopf's peering objects are ours and kopf's CRDs, not built-ins.
    ours = {"CacheReplica", "ClusterKopfPeering", "KopfPeering"}
    built_in = [d for d in rendered[scenario] if d["kind"] not in ours]
    assert len(built_in) > 10
    for doc in built_in:
        # Raises on any schema error; SchemaNotFoundError (an unknown kind) fails too.
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cache_replicas_match_the_crd_and_the_operators_checks(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    validator = jsonschema.Draft7Validator(crd_schema())
    (served,) = CustomResource.from_crd(yaml.safe_load(CRD_FILE.read_text()))
    for doc in objects(rendered[scenario], "CacheReplica").values():
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == []
        served.admit(doc, None)  # the CRD's CEL rules too, as the API server runs them
        check(doc["metadata"]["name"], doc["spec"])  # raises SpecError if it would be Degraded


def test_scenarios_render_cache_replicas() -> None:
    assert {"gpu-replicas-values", "tracing-values", "dev-cpu-values"} <= set(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_labels_names_and_selectors(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    docs = rendered[scenario]
    keys = Counter((d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs)
    assert [k for k, n in keys.items() if n > 1] == []
    for doc in docs:
        if doc["kind"] == "CustomResourceDefinition":
            continue
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "component", "version", "part-of", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], doc["metadata"]["name"], key)
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)]
    for workload in workloads(docs):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    for service in objects(docs, "Service").values():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), service["metadata"]
    for pdb in objects(docs, "PodDisruptionBudget").values():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= labels.items() for labels in pod_labels)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_secret_references_resolve(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    docs = rendered[scenario]
    secrets = {name: doc.get("data", {}) for name, doc in objects(docs, "Secret").items()}
    external = "cachepoint-ledger" if scenario == "external-postgres-values" else None
    for workload in workloads(docs):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            refs = [
                e["valueFrom"]["secretKeyRef"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            ]
            refs += [
                {"name": s["secretRef"]["name"]}
                for s in container.get("envFrom", [])
                if "secretRef" in s
            ]
            for ref in refs:
                if ref["name"] == external:
                    continue
                assert ref["name"] in secrets, ref
                if "key" in ref:
                    assert ref["key"] in secrets[ref["name"]], ref


def test_templates_are_named_kind_dash_component(helm: str) -> None:
    everything = [
        "-f",
        CHART / "ci" / "tracing-values.yaml",
        "-f",
        CHART / "ci" / "gpu-replicas-values.yaml",
    ]
    seen = set()
    for extra in ([], everything):
        out = run_helm(helm, "template", RELEASE, CHART, "--kube-version", KUBE_VERSION, *extra)
        for chunk in out.split("\n---"):
            source = re.search(r"# Source: cachepoint/templates/(\S+)", chunk)
            doc = yaml.safe_load(chunk)
            if not source or not doc:
                continue
            path = source.group(1)
            prefix = FILE_PREFIX.get(doc["kind"], doc["kind"].lower())
            assert Path(path).name.startswith(prefix + "-"), (path, doc["kind"])
            seen.add(path)
    on_disk = {
        str(p.relative_to(CHART / "templates")) for p in (CHART / "templates").rglob("*.yaml")
    }
    assert on_disk == seen  # and every template renders in one of the two


def test_default_install(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["default"]
    assert one(docs, "CustomResourceDefinition", "cachereplicas.cachepoint.dev")
    assert one(docs, "StatefulSet", f"{FULLNAME}-nats")
    assert one(docs, "StatefulSet", f"{FULLNAME}-postgresql")
    assert objects(docs, "CacheReplica") == {}
    assert objects(docs, "HorizontalPodAutoscaler") == {}
    assert "Deployment" not in {d["kind"] for d in docs if "otel" in d["metadata"]["name"]}
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/cachepoint/cachepoint-gateway:0.1.0"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    gw_env = env(container)
    # Fully qualified: members in other namespaces than the release's use the same URL.
    nats_url = f"nats://{FULLNAME}-nats.{NAMESPACE}.svc.cluster.local:4222"
    assert gw_env["CACHEPOINT_GATEWAY_NATS_URL"] == nats_url
    assert gw_env["CACHEPOINT_GATEWAY_DATABASE_URL"]["secretKeyRef"]["key"] == "DATABASE_URL"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in gw_env
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")
    op = operator["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in op["args"]
    assert env(op)["CACHEPOINT_OPERATOR_NATS_URL"] == nats_url
    # Two replicas with kopf peering: one works, one stands by; roll without a gap.
    assert operator["spec"]["replicas"] == 2
    assert operator["spec"]["strategy"]["type"] == "RollingUpdate"
    assert any(a.startswith("--peering=") for a in op["args"])
    db = one(docs, "Secret", f"{FULLNAME}-gateway-db")["data"]
    url = base64.b64decode(db["DATABASE_URL"]).decode()
    password = base64.b64decode(db["POSTGRES_PASSWORD"]).decode()
    assert url.startswith("postgresql+psycopg://cachepoint:")
    assert f":{password}@{FULLNAME}-postgresql:5432/cachepoint" in url


def test_operator_rbac_is_least_privilege(rendered: dict[str, list[dict[str, Any]]]) -> None:
    role = one(rendered["default"], "ClusterRole", f"{FULLNAME}-operator")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # Exactly what operator/kube.py and kopf call, nothing else (no list/watch of
    # secrets, no "*"): secrets only by name, for each CacheReplica's credentials.
    needed = {("cachepoint.dev", "cachereplicas", v) for v in ("get", "list", "watch", "patch")}
    needed |= {("cachepoint.dev", "cachereplicas/status", v) for v in ("get", "patch")}
    # OwnerReferencesPermissionEnforcement (OpenShift): blockOwnerDeletion needs it.
    needed |= {("cachepoint.dev", "cachereplicas/finalizers", "update")}
    # The pod index watches member pods (one stream, no LIST per tick).
    needed |= {("", "pods", v) for v in ("list", "watch", "create", "delete")}
    needed |= {("", "services", v) for v in ("get", "create", "patch", "delete")}
    needed |= {("policy", "poddisruptionbudgets", v) for v in ("get", "create", "patch", "delete")}
    needed |= {("", "events", "create")}
    needed |= {("", "secrets", v) for v in ("get", "create", "patch", "delete")}
    # Each CacheReplica's NetworkPolicy (networkPolicy.enabled): no delete, the garbage
    # collector removes it with its CacheReplica.
    needed |= {("networking.k8s.io", "networkpolicies", v) for v in ("get", "create", "patch")}
    # Two operator replicas with kopf peering (the default): cluster-wide peering object.
    needed |= {("kopf.dev", "clusterkopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    assert granted == needed
    binding = one(rendered["default"], "ClusterRoleBinding", f"{FULLNAME}-operator")
    assert binding["subjects"][0]["name"] == f"{FULLNAME}-operator"


def test_gpu_replicas(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["gpu-replicas-values"]
    replicas = objects(docs, "CacheReplica")
    assert sorted(replicas) == ["llama-70b", "llama-8b"]
    big = replicas["llama-70b"]["spec"]
    assert (big["tensorParallelSize"], big["gpusPerPod"]) == (4, 4)
    assert big["image"] == "ghcr.io/cachepoint/cachepoint-replica-cuda:0.1.0"
    assert replicas["llama-8b"]["metadata"]["namespace"] == NAMESPACE
    # Namespaced operator: a Role in the watched namespace, no ClusterRole for it.
    assert f"{FULLNAME}-operator" not in objects(docs, "ClusterRole")
    assert one(docs, "Role", f"{FULLNAME}-operator")["metadata"]["namespace"] == "cachepoint"
    op = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert "--namespace=cachepoint" in op["containers"][0]["args"]
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    assert "replicas" not in gateway["spec"]  # the HPA owns the count
    assert one(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-gateway")["spec"]["maxReplicas"] == 6
    gw_env = env(gateway["spec"]["template"]["spec"]["containers"][0])
    assert gw_env["CACHEPOINT_GATEWAY_MODELS"] == '["llama-3-8b","llama-3-70b"]'
    assert gw_env["CACHEPOINT_GATEWAY_MIN_CACHEABLE_TOKENS"] == "1024"
    assert gw_env["CACHEPOINT_GATEWAY_MODEL_DIR"] == "/models/llama-3-8b"


def test_external_postgres_and_nats(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["external-postgres-values"]
    assert objects(docs, "StatefulSet") == {}
    assert f"{FULLNAME}-gateway-db" not in objects(docs, "Secret")
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    gw_env = env(gateway["spec"]["template"]["spec"]["containers"][0])
    assert gw_env["CACHEPOINT_GATEWAY_DATABASE_URL"] == {
        "secretKeyRef": {"name": "cachepoint-ledger", "key": "url"}
    }
    assert gw_env["CACHEPOINT_GATEWAY_NATS_URL"] == "nats://nats.messaging.svc.cluster.local:4222"
    assert one(docs, "Service", f"{FULLNAME}-gateway")["spec"]["type"] == "LoadBalancer"

    by_url = rendered["external-postgres-url-values"]
    secret = one(by_url, "Secret", f"{FULLNAME}-gateway-db")["data"]
    assert set(secret) == {"DATABASE_URL"}
    assert (
        base64.b64decode(secret["DATABASE_URL"])
        .decode()
        .endswith("@db.example.com:5432/cachepoint")
    )


def test_tracing_on(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["tracing-values"]
    # Fully qualified: member pods in any namespace reach it.
    collector = f"http://{FULLNAME}-otel-collector.{NAMESPACE}.svc.cluster.local:4317"
    config = yaml.safe_load(
        one(docs, "ConfigMap", f"{FULLNAME}-otel-collector")["data"]["config.yaml"]
    )
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == f"{FULLNAME}-jaeger:4317"
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert one(docs, "Service", f"{FULLNAME}-jaeger")["spec"]["ports"][0]["port"] == 16686
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    gw_env = env(gateway["containers"][0])
    assert gw_env["OTEL_EXPORTER_OTLP_ENDPOINT"] == collector
    assert gw_env["OTEL_SERVICE_NAME"] == "cachepoint-gateway"
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert env(operator["containers"][0])["CACHEPOINT_OPERATOR_OTLP_ENDPOINT"] == collector
    tiny = one(docs, "CacheReplica", "tiny")["spec"]
    assert (
        tiny["image"] == "ghcr.io/cachepoint/cachepoint-replica-cpu:0.1.0"
    )  # gpusPerPod 0: the CPU image


def test_helm_test_pod_calls_the_gateway_health_endpoint(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    pod = one(rendered["default"], "Pod", f"{FULLNAME}-gateway-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert f"http://{FULLNAME}-gateway:80/healthz" in script
    compile(script, "helm-test", "exec")  # the inline Python is valid


def test_notes_tell_how_to_reach_key_and_bill(helm: str, tmp_path: Path) -> None:
    # helm template leaves NOTES.txt out; render it through a probe template in a copy.
    chart = tmp_path / "cachepoint"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "configmap-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n"
        '  notes: {{ include (print $.Template.BasePath "/NOTES.txt") . | quote }}\n'
    )
    docs = render(
        helm, "tracing-values", "--show-only", "templates/configmap-notes.yaml", chart=chart
    )
    notes = docs[0]["data"]["notes"]
    assert f"port-forward svc/{FULLNAME}-gateway" in notes
    assert "keys create --org acme --quiet" in notes
    assert "usage_report/messages?starting_at=" in notes
    assert "cost_report" in notes
    assert f"svc/{FULLNAME}-jaeger 16686" in notes


def test_schema_rejects_typos_and_missing_external_settings(helm: str) -> None:
    for bad in (
        ["--set", "gatway.replicas=1"],
        ["--set", "nats.mode=external"],
        ["--set", "postgresql.mode=external"],
        ["--set", "replicas[0].name=Bad_Name", "--set", "replicas[0].model.name=m"],
    ):
        with pytest.raises(AssertionError, match="failed"):
            run_helm(helm, "template", RELEASE, CHART, "--kube-version", KUBE_VERSION, *bad)


def test_every_value_is_commented() -> None:
    """Each setting has a `# -- ...` comment block (helm-docs style) right above it, or
    sits inside a block that has one (e.g. the keys under a documented `resources:`)."""
    lines = (CHART / "values.yaml").read_text().splitlines()

    def has_doc(number: int) -> bool:
        first = number
        while first > 0 and lines[first - 1].strip().startswith("#"):
            first -= 1
        return first < number and lines[first].strip().startswith("# --")

    ancestors: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    missing = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):(.*)$", line)
        if not match:
            continue
        indent = len(match.group(1))
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        own = has_doc(number)
        is_leaf = bool(match.group(3).strip())  # a value on the line: a setting, not a section
        if is_leaf and not own and not any(flag for _, flag in ancestors):
            missing.append(f"{number + 1}: {line.strip()}")
        ancestors.append((indent, own))
    assert missing == []


def test_schema_covers_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(values)
    assert set(values) == set(schema["properties"])


@pytest.mark.parametrize(
    "example", sorted((CHART.parent / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_example_cache_replicas_are_accepted(example: Path) -> None:
    doc = yaml.safe_load(example.read_text())
    errors = list(jsonschema.Draft7Validator(crd_schema()).iter_errors(doc))
    assert errors == []
    check(doc["metadata"]["name"], doc["spec"])
