"""A Kubernetes API for the operator to drive, shared by tests/operator and the benches.

kmock serves the API, with the parts of a real API server it lacks added by the
emulator (`emulator.py`, `apiserver/`: schema and CEL validation from the chart's CRDs,
RBAC from the chart's roles, object lifecycle, fault injection). Here: the resources the
operator uses and a kubeconfig for its identity (`prepare_cluster`), a kubectl-like view
of them (`Cluster`), the real operator under kopf's test runner (`running_operator`), a
stand-in for the scheduler and kubelet (`run_kubelet`) and a replica's stats endpoint
(`StatsServer`). tests/operator's fixtures wrap these; bench/operator_load_bench.py uses
them at scale.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kmock
import yaml
from kmock import ResourceInfo

from cachepoint.bench.kube.apiserver import chart
from cachepoint.bench.kube.apiserver.rbac import Authorizer
from cachepoint.bench.kube.emulator import ApiServer

# The timer interval is fixed when the handlers module is imported (kopf decorators),
# so the fast timings must be in the environment before anything imports it.
os.environ.update(
    {
        "CACHEPOINT_OPERATOR_STATS_INTERVAL": "0.2",
        "CACHEPOINT_OPERATOR_STATS_TIMEOUT": "1",
        "CACHEPOINT_OPERATOR_RETRY_DELAY": "0.2",
        "CACHEPOINT_OPERATOR_NATS_URL": "nats://cachepoint-nats:4222",
        "CACHEPOINT_OPERATOR_OTLP_ENDPOINT": "http://cachepoint-otel-collector:4317",
        "CACHEPOINT_OPERATOR_INTERNAL_TOKEN": "operator-test-token",
        "CACHEPOINT_OPERATOR_NATS_USERS_SECRET": "rel-cachepoint-nats-users",
        "CACHEPOINT_OPERATOR_RELEASE_NAMESPACE": "cachepoint",
    }
)
INTERNAL_TOKEN = "operator-test-token"
# The operator's bearer token for the API: its requests are authorized by the chart's RBAC,
# while the tests' own (no token) act as cluster-admin.
OPERATOR_API_TOKEN = "test-token"
USERS_SECRET = ("cachepoint", "rel-cachepoint-nats-users")  # the chart's (namespace, name)

NAMESPACE = "serving"
CR = "cachepoint.dev/v1alpha1/cachereplicas"
PODS = "v1/pods"
SERVICES = "v1/services"
EVENTS = "v1/events"
SECRETS = "v1/secrets"
PDBS = "policy/v1/poddisruptionbudgets"
NETPOLS = "networking.k8s.io/v1/networkpolicies"


def cache_replica(name: str, **spec: Any) -> dict[str, Any]:
    body = {"image": "ghcr.io/cachepoint/replica:1.0", "model": {"name": "llama-3-8b"}, **spec}
    return {
        "apiVersion": "cachepoint.dev/v1alpha1",
        "kind": "CacheReplica",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": body,
    }


class Cluster:
    """What a test does to and reads from the API, as kubectl would."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def path(self, resource: str, name: str | None = None, sub: str | None = None) -> str:
        group_version, plural = resource.rsplit("/", 1)
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{base}/namespaces/{NAMESPACE}/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def create(self, body: dict[str, Any]) -> None:
        response = await self.server.post(self.path(CR), json=body)
        assert response.status in (200, 201), await response.text()

    async def patch(self, name: str, patch: dict[str, Any], sub: str | None = None) -> None:
        headers = {"Content-Type": "application/merge-patch+json"}
        response = await self.server.patch(
            self.path(CR, name, sub), data=json.dumps(patch), headers=headers
        )
        assert response.status == 200, await response.text()

    async def delete(self, name: str) -> None:
        response = await self.server.delete(self.path(CR, name))
        assert response.status == 200, await response.text()

    def get(self, name: str, resource: str = CR) -> dict[str, Any] | None:
        return self.server.current(kmock.resource(resource), NAMESPACE, name)

    def list(self, resource: str) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        return [
            obj.raw
            for (res, _ns, _name), obj in self.server.objects.items()
            if res == wanted and not obj.deleted
        ]

    def pods(self) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.list(PODS)}

    def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data, decoded; None when there is none."""
        obj = self.server.current(kmock.resource(SECRETS), namespace, name)
        if obj is None:
            return None
        return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}

    async def wait(self, check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
        """Poll until `check()` is truthy; return its value. Awaits, so kmock keeps serving."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def prepare_cluster(kmock: ApiServer, kubeconfig: Path) -> Cluster:
    """Serve the resources the operator uses, the chart's CRDs and RBAC, and write a
    kubeconfig for the operator's identity to `kubeconfig` (point KUBECONFIG at it)."""
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    kmock.resources[CR] = ResourceInfo(
        kind="CacheReplica",
        singular="cachereplica",
        namespaced=True,
        verbs=verbs,
        subresources={"status", "scale"},
    )
    kmock.resources[PODS] = ResourceInfo(
        kind="Pod", namespaced=True, verbs=verbs, subresources={"status"}
    )
    kmock.resources[SERVICES] = ResourceInfo(kind="Service", namespaced=True, verbs=verbs)
    kmock.resources[EVENTS] = ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
    kmock.resources[SECRETS] = ResourceInfo(kind="Secret", namespaced=True, verbs=verbs)
    kmock.resources[PDBS] = ResourceInfo(kind="PodDisruptionBudget", namespaced=True, verbs=verbs)
    kmock.resources[NETPOLS] = ResourceInfo(kind="NetworkPolicy", namespaced=True, verbs=verbs)
    # kopf waits for these two to be discoverable before it starts, even though with
    # scanning disabled and -A it never lists them (listing namespaces trips kmock 0.8).
    kmock.resources["v1/namespaces"] = ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=verbs
    )
    for crd in chart.crds():
        kmock.install_crd(crd)
    authorizer = Authorizer.from_manifests(chart.rendered_rbac(), chart.OPERATOR_SERVICE_ACCOUNT)
    kmock.enable_rbac(authorizer, OPERATOR_API_TOKEN)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": OPERATOR_API_TOKEN}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
        "current-context": "kmock",
    }
    kubeconfig.write_text(yaml.safe_dump(config))
    return Cluster(kmock)


@contextlib.asynccontextmanager
async def running_operator() -> AsyncIterator[Any]:
    """The real operator, as `kopf run -A --standalone -m cachepoint.operator.handlers`."""
    # NOTE: imported here, not at the top: importing the handlers registers them with
    # kopf and reads the operator's settings, and a test may change the environment
    # (the module-level defaults above, or its own) before it starts an operator.
    import kopf
    from kopf.testing import KopfRunner

    from cachepoint.operator import handlers  # noqa: F401  (registers the handlers)

    args = ["run", "-A", "--standalone", "--verbose", "-m", "cachepoint.operator.handlers"]
    runner = KopfRunner(args, registry=kopf.get_default_registry(), timeout=30)
    # kopf's CLI reconfigures logging process-wide (a root handler on the runner's own,
    # soon closed, stream; DEBUG level; asyncio muted): put it back for later tests.
    root, quiet = logging.getLogger(), logging.getLogger("asyncio")
    saved = (root.level, root.handlers[:], quiet.propagate, quiet.handlers[:])
    # Enter and leave in threads: both block, and the API server lives in this loop.
    await asyncio.to_thread(runner.__enter__)
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        quiet.propagate, quiet.handlers[:] = saved[2], saved[3]
    assert runner.exit_code == 0, runner.output


async def run_kubelet(cluster: Cluster, period: float = 0.05) -> None:
    """Plays the scheduler and the kubelet, until cancelled: every new pod is bound to a
    node, starts, gets 127.0.0.1 as its IP and turns Ready; a deleted one stops and is
    confirmed gone."""
    while True:
        for name, pod in cluster.pods().items():
            if pod["metadata"].get("deletionTimestamp"):
                # NOTE: the stub's containers stop at once on SIGTERM; the kubelet then
                # confirms with a zero grace, which is what removes a terminating pod.
                await cluster.server.confirm_termination(kmock.resource(PODS), NAMESPACE, name)
                continue
            if pod.get("status", {}).get("podIP"):
                continue
            if not pod.get("spec", {}).get("nodeName"):
                # The scheduler's binding: with a node, a delete gets the grace period.
                await cluster.server.patch(
                    cluster.path(PODS, name), json={"spec": {"nodeName": "kmock-node"}}
                )
            status = {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [
                    {"name": "replica", "ready": True, "restartCount": 0, "state": {}}
                ],
            }
            await cluster.server.patch(cluster.path(PODS, name, "status"), json={"status": status})
        await asyncio.sleep(period)


class StatsServer:
    """A real HTTP server standing in for a replica's /healthz, /readyz and /v1/stats."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {
            "replica": "stub",
            "epoch": 1,
            "model": "llama-3-8b",
            "block_size": 16,
            "max_model_len": 8192,
            "blocks": {
                "total": 1000,
                "active": 100,
                "cached_free": 300,
                "empty": 600,
                "retained": 50,
                "max_retained": 500,
            },
            "entries": 7,
            "query_tokens": 4000,
            "hit_tokens": 3000,
            "hit_rate": 0.75,
            "evictions": 0,
            "retain_refusals": 0,
            "waiting": 0,
            "running": 1,
            "queued_prefill_tokens": 0,
            "max_waiting": 256,
        }
        self.delay_s = 0.0  # how long /v1/stats takes to answer (a slow replica)
        self.stats_calls = 0  # /v1/stats requests received, ever
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                # Like a replica with an internal token: /v1/stats only with the token.
                token = self.headers.get("authorization")
                if self.path == "/v1/stats" and token != f"Bearer {INTERNAL_TOKEN}":
                    self.send_error(401)
                    return
                if self.path == "/v1/stats":
                    owner.stats_calls += 1
                    time.sleep(owner.delay_s)
                    body = json.dumps(owner.stats).encode()
                elif self.path in ("/healthz", "/readyz"):
                    body = b"ok"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
