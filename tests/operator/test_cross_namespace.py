"""What the chart tells the operator reaches member pods in any namespace.

Member pods run in their CacheReplica's namespace, not the release's: every service
name the chart hands the operator for them must be fully qualified, or it resolves to
nothing there (NATS, the OTLP collector). Rendered with the real helm binary.
"""

from __future__ import annotations

import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from cachepoint.bench.kube.apiserver.chart import CHART, ChartError, find_helm
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.pod import build_replica_pod
from cachepoint.operator.spec import parse_spec

RELEASE, RELEASE_NAMESPACE = "rel", "cachepoint"


def render(*values: str) -> list[dict[str, Any]]:
    try:
        helm = find_helm()
    except ChartError as e:
        pytest.fail(str(e))
    args = [helm, "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE]
    for value in values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    (deployment,) = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def service_hosts(env: dict[str, str]) -> dict[str, str]:
    """The host of every URL among the env values."""
    return {
        name: urlsplit(value).hostname or ""
        for name, value in env.items()
        if "://" in value and urlsplit(value).hostname not in ("0.0.0.0", "localhost")
    }


def test_member_pods_in_another_namespace_get_fully_qualified_services() -> None:
    docs = render("tracing.enabled=true")
    env = operator_env(docs)
    hosts = service_hosts(env)
    # The walk did see both endpoints the chart hands over.
    assert {"CACHEPOINT_OPERATOR_NATS_URL", "CACHEPOINT_OPERATOR_OTLP_ENDPOINT"} <= set(hosts)
    suffix = f".{RELEASE_NAMESPACE}.svc.cluster.local"
    for name, host in hosts.items():
        assert host.endswith(suffix), f"{name}: {host} is not fully qualified"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for name, host in hosts.items():
        assert host.removesuffix(suffix) in services, f"{name}: no Service {host}"

    # And so, through the operator, do the member pods of a CacheReplica elsewhere.
    config = OperatorConfig.from_env(env)
    pod = build_replica_pod(
        replica="llama",
        namespace="team-a",
        index=0,
        spec=parse_spec({"image": "replica:1", "model": {"name": "m"}}),
        config=config,
    )
    pod_env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    pod_hosts = service_hosts(pod_env)
    assert {"CACHEPOINT_NATS_URL", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= set(pod_hosts)
    for name, host in pod_hosts.items():
        assert host.endswith(".svc.cluster.local"), f"{name}: {host} is not fully qualified"


def test_an_external_collector_is_passed_as_given() -> None:
    endpoint = "http://otel.observability.svc.cluster.local:4317"
    env = operator_env(render(f"tracing.otlpEndpoint={endpoint}"))
    assert env["CACHEPOINT_OPERATOR_OTLP_ENDPOINT"] == endpoint
    assert "CACHEPOINT_OPERATOR_OTLP_ENDPOINT" not in operator_env(render())
