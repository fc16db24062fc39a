"""End to end on real processes: the operator with the rendered chart's settings, the
emulated API server, a process kubelet (member pods are real `cachepoint-replica`
processes), a real nats-server whose users follow the operator's Secret, and the
gateway on PostgreSQL, driven through the official `anthropic` SDK.

One test walks what a cluster does to a deployment in a day:
- two CacheReplicas in two namespaces, serving two models: each model's requests reach
  only its own members;
- a rolling update of one under a client loop: no failed request, at most
  maxUnavailable members down at any time, and the ledger equals the usage returned;
- a member container killed (restarted in place), a member pod evicted (Failed:
  replaced by the operator) and one deleted from outside (`kubectl delete pod`, a node
  drain: recreated by the operator);
- `kubectl scale` through the scale subresource.

What is emulated and why: no cluster DNS here, so the kubelet maps service names to
local addresses in env values (process_kubelet.py) and the gateway accepts any
announced URL (`--replica-url-check off`; in a cluster it checks the k8s DNS shape).
The operator's timings are shortened from the chart's (10 s ticks) to keep CI short.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import kmock
import pytest
import yaml
from sqlalchemy import create_engine, text

from cachepoint.bench.kube.cluster import Cluster, running_operator

from .process_kubelet import BIN, NatsUsersReloader, ProcessKubelet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "cachepoint"
RELEASE, RELEASE_NS = "rel", "cachepoint"
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
CR = "cachepoint.dev/v1alpha1/cachereplicas"
BUCKETS = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# ---------------------------------------------------------------- the chart


def _helm() -> str:
    import shutil

    found = shutil.which("helm") or str(ROOT / ".tools/bin/helm")
    if not Path(found).exists():
        pytest.fail("no helm: run `make .tools/bin/helm`")
    return found


def render_chart() -> list[dict[str, Any]]:
    argv = [_helm(), "template", RELEASE, str(CHART), "--namespace", RELEASE_NS]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _find(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"].endswith(suffix):
            return d
    raise AssertionError(f"the chart renders no {kind} *{suffix}")


def _secret_value(docs: list[dict[str, Any]], name: str, key: str) -> str:
    for d in docs:
        if d["kind"] == "Secret" and d["metadata"]["name"] == name:
            return base64.b64decode(d["data"][key]).decode()
    raise AssertionError(f"the chart renders no Secret {name} with {key}")


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The operator container's environment as kubelet would give it."""
    deployment = _find(docs, "Deployment", "-operator")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in (item.get("valueFrom") or {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = _secret_value(docs, ref["name"], ref["key"])
    return env


# ---------------------------------------------------------------- processes


def _wait_tcp(port: int, timeout: float = 20) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


@contextlib.contextmanager
def postgres_db() -> Iterator[str]:
    name = f"cp_e2e_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def seed_tenant(db_url: str) -> str:
    from cachepoint.gateway.db.migrate import upgrade
    from cachepoint.gateway.db.session import make_engine, make_sessionmaker
    from cachepoint.gateway.tenancy.tenants import create_key, create_org

    engine = make_engine(db_url)
    upgrade(engine)
    try:
        with make_sessionmaker(engine)() as s:
            org = create_org(s, "e2e")
            key = create_key(s, org, name="e2e")[1]
            s.commit()
    finally:
        engine.dispose()
    return key


def ledger(db_url: str) -> dict[str, dict[str, int]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT request_id, input_tokens, cache_read_input_tokens, "
                    "cache_write_5m_tokens, cache_write_1h_tokens, output_tokens FROM usage"
                )
            ).fetchall()
    finally:
        engine.dispose()
    return {r[0]: dict(zip(BUCKETS, r[1:], strict=True)) for r in rows}


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the API, as kubectl


class Kubectl:
    def __init__(self, cluster: Cluster) -> None:
        self.server = cluster.server

    @staticmethod
    def path(resource: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        group_version, plural = resource.rsplit("/", 1)
        base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        path = f"{base}/namespaces/{namespace}/{plural}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def create(self, resource: str, body: dict[str, Any]) -> None:
        ns = body["metadata"]["namespace"]
        r = await self.server.post(self.path(resource, ns), json=body)
        assert r.status in (200, 201), await r.text()

    async def patch(
        self, resource: str, ns: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> None:
        r = await self.server.patch(
            self.path(resource, ns, name, sub),
            data=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.status == 200, await r.text()

    async def delete(self, resource: str, ns: str, name: str, **body: Any) -> None:
        r = await self.server.delete(self.path(resource, ns, name), json=body or None)
        assert r.status in (200, 202), await r.text()

    def get(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        return self.server.current(kmock.resource(resource), ns, name)

    def list(self, resource: str) -> list[dict[str, Any]]:
        wanted = kmock.resource(resource)
        return [
            obj.raw
            for (res, _ns, _name), obj in self.server.objects.items()
            if res == wanted and not obj.deleted
        ]


def cache_replica(name: str, namespace: str, model: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "cachepoint.dev/v1alpha1",
        "kind": "CacheReplica",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "image": "ghcr.io/cachepoint/cachepoint-replica-cpu:e2e",
            "gpusPerPod": 0,
            "model": {"name": model},
            "kv": {"cacheBytes": "16Mi", "minCacheableTokens": 16},
            "drain": {"gracePeriodSeconds": 20},
            # Four replicas share two cores here.
            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
        },
    }


# ---------------------------------------------------------------- the test


class Fleet:
    """Everything but the operator: NATS, the kubelet, the gateway and a client."""

    def __init__(self, gateway_url: str, api_key: str, db_url: str) -> None:
        self.gateway_url, self.api_key, self.db_url = gateway_url, api_key, db_url
        self.request_ids: list[str] = []  # every answered call's, to check the ledger
        self.client = anthropic.Anthropic(
            base_url=gateway_url, api_key=api_key, max_retries=0, timeout=60
        )

    def ask(self, model: str, text_: str) -> tuple[str, dict[str, int], str]:
        """One call: (the replica that served it, its usage buckets, its request id)."""
        raw = self.client.messages.with_raw_response.create(
            model=model,
            max_tokens=6,
            system=[
                {
                    "type": "text",
                    "text": "You are a careful assistant. " * 8,
                    "cache_control": {"type": "ephemeral"},
                }
            ],
            messages=[{"role": "user", "content": text_}],
        )
        msg = raw.parse()
        u = msg.usage
        cc = u.cache_creation
        usage = {
            "input": u.input_tokens or 0,
            "cache_read": u.cache_read_input_tokens or 0,
            "cache_write_5m": (cc.ephemeral_5m_input_tokens or 0) if cc else 0,
            "cache_write_1h": (cc.ephemeral_1h_input_tokens or 0) if cc else 0,
            "output": u.output_tokens or 0,
        }
        rid = raw.headers.get("request-id", "")
        self.request_ids.append(rid)
        return raw.headers["cachepoint-replica"], usage, rid


@pytest.fixture
async def fleet(cluster: Cluster, tmp_path: Path) -> AsyncIterator[tuple[Fleet, ProcessKubelet]]:
    from cachepoint.operator import handlers
    from cachepoint.operator.config import OperatorConfig

    kubectl = Kubectl(cluster)
    docs = render_chart()
    # The chart's Secrets exist before the operator starts, as after `helm install`.
    for doc in docs:
        if doc["kind"] == "Secret":
            await kubectl.create("v1/secrets", doc)
    env = operator_env(docs)
    chart_config = OperatorConfig.from_env(env)
    assert chart_config.nats_url and chart_config.nats_users_secret and chart_config.internal_token
    config = chart_config.model_copy(
        update={"stats_interval": 0.3, "stats_timeout": 1.0, "retry_delay": 0.3}
    )
    gateway_password = _secret_value(docs, f"{RELEASE}-cachepoint-auth", "nats-gateway-password")
    token = config.internal_token.get_secret_value() if config.internal_token else ""

    from cachepoint.embedded.stack import free_port, nats_binary
    from cachepoint.replica.random_model import RANDOM_CONTEXT

    nport, gport = free_port(), free_port()
    conf_dir = tmp_path / "nats"
    conf_dir.mkdir()
    (conf_dir / "nats.conf").write_text('authorization {\n  include "users.conf"\n}\n')
    assert config.nats_users_secret is not None
    reloader = NatsUsersReloader(kubectl.get, RELEASE_NS, config.nats_users_secret, conf_dir)
    assert reloader.write(), "the chart seeds the NATS users Secret"
    nats_env = {**os.environ, "CACHEPOINT_NATS_GATEWAY_PASSWORD": gateway_password}
    nats_argv = [nats_binary(), "-c", str(conf_dir / "nats.conf"), "-a", "127.0.0.1"]
    nats_proc = _spawn([*nats_argv, "-p", str(nport)], tmp_path / "nats.log", nats_env)
    reloader.pid = nats_proc.pid
    _wait_tcp(nport)
    reload_task = asyncio.create_task(reloader.run())

    nats_host = config.nats_url.removeprefix("nats://")
    assert nats_host.endswith(".svc.cluster.local:4222"), nats_host  # reachable from any ns

    async def patch_status(ns: str, name: str, status: dict[str, Any]) -> None:
        await cluster.server.patch(
            Kubectl.path("v1/pods", ns, name, "status"),
            data=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def confirm_delete(ns: str, name: str) -> None:
        await cluster.server.delete(
            Kubectl.path("v1/pods", ns, name), json={"gracePeriodSeconds": 0}
        )

    kubelet = ProcessKubelet(
        list_pods=lambda: kubectl.list("v1/pods"),
        get=kubectl.get,
        patch_status=patch_status,
        confirm_delete=confirm_delete,
        dns={nats_host: f"127.0.0.1:{nport}"},
        log_dir=tmp_path / "pods",
    )
    gateway = None
    try:
        with postgres_db() as db_url:
            api_key = await asyncio.to_thread(seed_tenant, db_url)
            gateway_env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("CACHEPOINT_")},
                "CACHEPOINT_NATS_PASSWORD": gateway_password,
                "CACHEPOINT_INTERNAL_TOKEN": token,
                "CACHEPOINT_GATEWAY_MAX_CONTEXT_TOKENS": str(RANDOM_CONTEXT),
            }
            gateway_argv = [
                str(BIN / "python"),
                "-m",
                "cachepoint.gateway.cli",
                "--port",
                str(gport),
                "--db",
                db_url,
                "--nats-url",
                f"nats://127.0.0.1:{nport}",
                "--nats-user",
                "gateway",
                "--replica-url-check",
                "off",
                "--model",
                "model-a",
                "--model",
                "model-b",
                "--min-cacheable-tokens",
                "16",
                "--health-interval",
                "0.5",
                "--log-level",
                "warning",
            ]
            gateway = _spawn(gateway_argv, tmp_path / "gateway.log", gateway_env)
            await asyncio.to_thread(_wait_tcp, gport, 60)
            # The operator with the rendered chart's settings (timings shortened).
            original = handlers.CONFIG
            handlers.CONFIG = config
            try:
                async with kubelet, running_operator():
                    yield Fleet(f"http://127.0.0.1:{gport}", api_key, db_url), kubelet
            finally:
                handlers.CONFIG = original
    finally:
        reload_task.cancel()
        if gateway is not None:
            _stop(gateway)
        _stop(nats_proc)


async def _wait(check: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _ready_members(kubectl: Kubectl, ns: str, replica: str) -> dict[str, dict[str, Any]]:
    out = {}
    for pod in kubectl.list("v1/pods"):
        meta = pod["metadata"]
        if (
            meta["namespace"] != ns
            or (meta.get("labels") or {}).get("cachepoint.dev/replica") != replica
        ):
            continue
        if meta.get("deletionTimestamp"):
            continue
        conditions = pod.get("status", {}).get("conditions") or []
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
            out[meta["name"]] = pod
    return out


async def test_two_namespaces_two_models_roll_evict_kill_and_scale(
    fleet: tuple[Fleet, ProcessKubelet], cluster: Cluster
) -> None:
    f, kubelet = fleet
    kubectl = Kubectl(cluster)
    gateway = httpx.AsyncClient(base_url=f.gateway_url, timeout=5)

    async def live() -> int:
        try:
            return int((await gateway.get("/readyz")).json()["replicas_live"])
        except (httpx.HTTPError, ValueError, KeyError):
            return 0

    async def live_is(n: int) -> bool:
        return await live() == n

    await kubectl.create(CR, cache_replica("alpha", "team-a", "model-a", 2))
    await kubectl.create(CR, cache_replica("beta", "team-b", "model-b", 1))
    await _wait(lambda: len(_ready_members(kubectl, "team-a", "alpha")) == 2, "alpha ready")
    await _wait(lambda: len(_ready_members(kubectl, "team-b", "beta")) == 1, "beta ready")
    await _wait(lambda: live_is(3), "the gateway sees 3 members over NATS", 60)
    # Each namespace holds its members' ingress policy, made from the chart's settings
    # (the chart renders none in team-a or team-b). Nothing here enforces it: no CNI.
    for ns, name in (("team-a", "alpha"), ("team-b", "beta")):
        policy = kubectl.get("networking.k8s.io/v1/networkpolicies", ns, f"{name}-ingress")
        assert policy is not None, f"no NetworkPolicy for {ns}/{name}"
        peers = policy["spec"]["ingress"][0]["from"]
        assert peers[0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": RELEASE_NS
        }

    # Routing by model: each model's requests reach only its own CacheReplica.
    served = []
    for i in range(4):
        served.append((await asyncio.to_thread(f.ask, "model-a", f"alpha {i}"))[0])
        served.append((await asyncio.to_thread(f.ask, "model-b", f"beta {i}"))[0])
    assert {s for s in served[0::2]} <= {"team-a_alpha-0", "team-a_alpha-1"}, served
    assert set(served[1::2]) == {"team-b_beta-0"}, served

    # A rolling update of alpha under a client loop.
    calls: list[tuple[str, dict[str, int], str]] = []
    errors: list[str] = []
    stop = asyncio.Event()

    async def client_loop(model: str) -> None:
        i = 0
        while not stop.is_set():
            try:
                calls.append(await asyncio.to_thread(f.ask, model, f"roll turn {i}"))
            except Exception as exc:
                errors.append(repr(exc))
            i += 1

    loop_task = asyncio.create_task(client_loop("model-a"))
    hashes_before = {
        p["metadata"]["annotations"]["cachepoint.dev/template-hash"]
        for p in _ready_members(kubectl, "team-a", "alpha").values()
    }
    uids_before = {
        p["metadata"]["uid"] for p in _ready_members(kubectl, "team-a", "alpha").values()
    }
    env = [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "ROLL", "value": "2"}]
    await kubectl.patch(CR, "team-a", "alpha", {"spec": {"env": env}})
    max_down = 0
    deadline = time.monotonic() + 240
    while True:
        ready = _ready_members(kubectl, "team-a", "alpha")
        max_down = max(max_down, 2 - len(ready))
        new = [
            p
            for p in ready.values()
            if p["metadata"]["uid"] not in uids_before
            and p["metadata"]["annotations"]["cachepoint.dev/template-hash"] not in hashes_before
        ]
        if len(new) == 2:
            break
        assert time.monotonic() < deadline, f"the roll did not finish: {list(ready)}"
        await asyncio.sleep(0.1)
    await asyncio.sleep(2)  # a few more calls on the new members
    stop.set()
    await loop_task
    assert not errors, errors[:5]
    assert len(calls) >= 5, len(calls)
    assert max_down <= 1, f"{max_down} members down at once with maxUnavailable 1"
    assert {c[0] for c in calls} <= {"team-a_alpha-0", "team-a_alpha-1"}

    # The ledger matches what the clients were told, call by call and in sum.
    rows = await asyncio.to_thread(ledger, f.db_url)
    for _replica, usage, rid in calls:
        assert rows.get(rid) == usage, (rid, usage, rows.get(rid))
    for b in BUCKETS:
        assert sum(c[1][b] for c in calls) == sum(rows[c[2]][b] for c in calls), b

    # A crashed container is restarted in place; the operator sees a new epoch.
    kubelet.kill("team-b", "beta-0")
    await _wait(
        lambda: (
            (kubectl.get("v1/pods", "team-b", "beta-0") or {})
            .get("status", {})
            .get("containerStatuses", [{}])[0]
            .get("restartCount")
            == 1
            and "beta-0" in _ready_members(kubectl, "team-b", "beta")
        ),
        "beta-0 restarted and ready",
    )
    await _wait(
        lambda: any(
            m.get("restarts") == 1
            for m in (kubectl.get(CR, "team-b", "beta") or {}).get("status", {}).get("members", [])
        ),
        "the operator to count the restart",
        60,
    )
    # NOTE: pod readiness is the kubelet's probe; the gateway routes there once the new
    # process's first heartbeat (its new epoch) arrives, a moment later.
    await _wait(lambda: live_is(3), "the gateway routes to the restarted beta-0", 30)
    assert (await asyncio.to_thread(f.ask, "model-b", "after the crash"))[0] == "team-b_beta-0"

    # An evicted member (phase Failed) is replaced by a new pod.
    evicted_uid = kubectl.get("v1/pods", "team-a", "alpha-1")["metadata"]["uid"]
    await kubelet.fail("team-a", "alpha-1")
    await _wait(
        lambda: (
            (p := _ready_members(kubectl, "team-a", "alpha").get("alpha-1")) is not None
            and p["metadata"]["uid"] != evicted_uid
        ),
        "a new alpha-1",
    )

    # A member pod deleted from outside (kubectl delete pod, a node drain): recreated.
    deleted_uid = kubectl.get("v1/pods", "team-a", "alpha-0")["metadata"]["uid"]
    await kubectl.delete("v1/pods", "team-a", "alpha-0")
    await _wait(
        lambda: (
            (p := _ready_members(kubectl, "team-a", "alpha").get("alpha-0")) is not None
            and p["metadata"]["uid"] != deleted_uid
        ),
        "a new alpha-0",
    )
    await _wait(lambda: live_is(3), "the gateway routes to the new alpha-0", 30)
    assert (await asyncio.to_thread(f.ask, "model-a", "after the delete"))[0].startswith(
        "team-a_alpha-"
    )

    # Every answered call is in the ledger once, and nothing else is (no double billing
    # of a rerouted or retried call).
    rows = await asyncio.to_thread(ledger, f.db_url)
    assert sorted(rows) == sorted(f.request_ids)

    # kubectl scale through the scale subresource.
    await kubectl.patch(CR, "team-b", "beta", {"spec": {"replicas": 2}}, sub="scale")
    await _wait(lambda: len(_ready_members(kubectl, "team-b", "beta")) == 2, "beta scaled to 2")
    await _wait(lambda: live_is(4), "the gateway sees 4 members", 60)
    await gateway.aclose()
