"""The chart's side of event-plane auth: NATS users, the internal token, NetworkPolicies.

The NATS config is taken from the rendered chart and the users file from the operator's
own builder, then checked by the real nats-server: first `-t`, then served, to show
that a member's credentials let it speak only under its own name.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.errors import Error as NatsError

from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.naming import common_labels
from cachepoint.operator.nats_auth import build_users_conf, member_users
from cachepoint.operator.network import build_replica_network_policy

from .conftest import NAMESPACE, RELEASE, render
from .test_chart import FULLNAME, env, objects, one

NATS_SERVER = str(Path(sys.executable).parent / "nats-server")
# All digits: unquoted in nats-server's environment it would parse as a number.
GATEWAY_PASSWORD = "2026113001234567"
PASSWORDS = {"llama-0": "member0-password-0123456789", "llama-1": "member1-password-0123456789"}


def nats_conf(docs: list[dict[str, Any]]) -> str:
    return str(one(docs, "ConfigMap", f"{FULLNAME}-nats")["data"]["nats.conf"])


def lay_out(tmp: Path, docs: list[dict[str, Any]], users_conf: str) -> Path:
    """The two files where the StatefulSet mounts them, under `tmp` instead of /."""
    config = tmp / "etc" / "nats-config" / "nats.conf"
    users = tmp / "etc" / "nats-users" / "users.conf"
    config.parent.mkdir(parents=True)
    users.parent.mkdir(parents=True)
    # The pid file's folder is an emptyDir in the pod; here, a folder of the test's own.
    (tmp / "run").mkdir()
    config.write_text(nats_conf(docs).replace("/var/run/nats/", f"{tmp}/run/"))
    users.write_text(users_conf)
    return config


def operator_users(namespace: str = "serving") -> str:
    return build_users_conf(member_users(namespace, PASSWORDS))


def nats_env(docs: list[dict[str, Any]], password: str) -> dict[str, str]:
    """The NATS container's password variable, as the kubelet expands the chart's env."""
    pod = one(docs, "StatefulSet", f"{FULLNAME}-nats")["spec"]["template"]["spec"]
    value = env(pod["containers"][0])["CACHEPOINT_NATS_GATEWAY_PASSWORD"]
    expanded = value.replace("$(CACHEPOINT_NATS_GATEWAY_PASSWORD_RAW)", password)
    return {"CACHEPOINT_NATS_GATEWAY_PASSWORD": expanded}


def check_config(config: Path, environ_extra: dict[str, str] | None) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "CACHEPOINT_NATS_GATEWAY_PASSWORD"}
    environ.update(environ_extra or {})
    result = subprocess.run(
        [NATS_SERVER, "-t", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env=environ,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_statefulset_mounts_what_the_config_and_reloader_name(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    pod = one(docs, "StatefulSet", f"{FULLNAME}-nats")["spec"]["template"]["spec"]
    nats_c, reloader = pod["containers"]
    assert "--config=/etc/nats-config/nats.conf" in nats_c["args"]
    mounts = {m["name"]: m["mountPath"] for m in nats_c["volumeMounts"]}
    assert mounts["config"] == "/etc/nats-config"
    assert mounts["users"] == "/etc/nats-users"  # nats.conf includes ../nats-users/users.conf
    assert 'include "../nats-users/users.conf"' in nats_conf(docs)
    assert 'pid_file: "/var/run/nats/nats.pid"' in nats_conf(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["users"]["secret"]["secretName"] == f"{FULLNAME}-nats-users"
    assert volumes["config"]["configMap"]["name"] == f"{FULLNAME}-nats"
    # The reloader signals the server through the shared pid file, watching both files.
    assert pod["shareProcessNamespace"] is True
    assert reloader["image"].startswith("natsio/nats-server-config-reloader:")
    assert reloader["args"] == [
        "-pid",
        "/var/run/nats/nats.pid",
        "-config",
        "/etc/nats-config/nats.conf",
        "-config",
        "/etc/nats-users/users.conf",
    ]
    assert mounts["pid"] == "/var/run/nats"
    assert {m["name"]: m["mountPath"] for m in reloader["volumeMounts"]} == {
        k: v for k, v in mounts.items() if k != "data"
    }
    assert env(nats_c)["CACHEPOINT_NATS_GATEWAY_PASSWORD_RAW"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-auth", "key": "nats-gateway-password"}
    }


def test_the_chart_seeds_the_users_file_the_operator_would_write_for_no_members(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    secret = one(rendered["default"], "Secret", f"{FULLNAME}-nats-users")["data"]
    assert base64.b64decode(secret["users.conf"]).decode() == build_users_conf({})
    assert base64.b64decode(secret["members.json"]).decode() == "{}"


def test_nats_server_accepts_the_chart_config_with_seed_and_operator_users(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["default"]
    environ = nats_env(docs, GATEWAY_PASSWORD)
    check_config(lay_out(tmp_path / "seed", docs, build_users_conf({})), environ)
    check_config(lay_out(tmp_path / "members", docs, operator_users()), environ)
    with pytest.raises(AssertionError, match="GATEWAY_PASSWORD"):
        # Without the gateway's password in its environment the server refuses to start.
        check_config(lay_out(tmp_path / "no-env", docs, operator_users()), None)
    # Why the chart quotes it: a bare all-digit password is read as a number.
    bare = {"CACHEPOINT_NATS_GATEWAY_PASSWORD": GATEWAY_PASSWORD}
    with pytest.raises(AssertionError, match=r"int64|integer"):
        check_config(lay_out(tmp_path / "bare", docs, operator_users()), bare)


# ------------------------------------------------------------------ a served config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> Iterator[dict[str, Any]]:
    """nats-server on the chart's config and the operator's users for serving/llama."""
    config = lay_out(tmp_path, rendered["default"], operator_users())
    port = _free_port()
    proc = subprocess.Popen(
        [NATS_SERVER, "-c", str(config), "-a", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **nats_env(rendered["default"], GATEWAY_PASSWORD)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            assert time.time() < deadline, "nats-server did not start"
            time.sleep(0.05)
    yield {"url": f"nats://127.0.0.1:{port}", "proc": proc, "users": config.parent.parent}
    proc.kill()
    proc.wait(10)


async def _connect(url: str, user: str | None = None, password: str | None = None) -> Any:
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    creds = {"user": user, "password": password} if user else {}
    nc = await nats.connect(
        url, allow_reconnect=False, connect_timeout=2, error_cb=on_error, **creds
    )
    nc.async_errors = errors  # type: ignore[attr-defined]
    return nc


async def _refused(url: str, user: str | None = None, password: str | None = None) -> bool:
    try:
        nc = await _connect(url, user, password)
    except (NatsError, OSError):
        return True
    await nc.close()
    return False


async def test_members_speak_only_under_their_own_name(
    served: dict[str, Any], nats_settle: Callable[[Any], Awaitable[None]]
) -> None:
    url = served["url"]
    assert await _refused(url)  # no anonymous access
    assert await _refused(url, "serving_llama-0", "not-the-password-0123")
    assert await _refused(url, "gateway", "not-the-password-0123")

    gateway = await _connect(url, "gateway", GATEWAY_PASSWORD)
    member0 = await _connect(url, "serving_llama-0", PASSWORDS["llama-0"])
    received: list[str] = []

    async def got(msg: Any) -> None:
        received.append(msg.subject)

    await gateway.subscribe("cachepoint.kv.*", cb=got)
    await gateway.subscribe("cachepoint.replica.heartbeat.*", cb=got)
    await nats_settle(gateway)

    own = ["cachepoint.kv.serving_llama-0", "cachepoint.replica.heartbeat.serving_llama-0"]
    forged = ["cachepoint.kv.serving_llama-1", "cachepoint.replica.heartbeat.serving_llama-1"]
    forged += ["cachepoint.replica.heartbeat.fake", "cachepoint.kv.snapshot.serving_llama-1"]
    for subject in own + forged:
        await member0.publish(subject, b"x")
    await nats_settle(member0)
    await nats_settle(gateway)
    # NOTE: waits for delivery rather than a fixed pause, then a little longer for
    # anything forged that might still arrive.
    deadline = time.monotonic() + 10
    while (len(received) < len(own) or len(member0.async_errors) < len(forged)) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert sorted(received) == sorted(own)  # the forged ones never reach the gateway
    violations = sorted(str(e) for e in member0.async_errors)
    assert violations == sorted(f'nats: permissions violation for publish to "{s}"' for s in forged)

    # It answers snapshot requests for its own name only, through allow_responses.
    async def answer(msg: Any) -> None:
        await msg.respond(b"snapshot")

    await member0.subscribe("cachepoint.kv.snapshot.serving_llama-0", cb=answer)
    await member0.subscribe("cachepoint.kv.snapshot.serving_llama-1", cb=answer)
    await nats_settle(member0)
    await asyncio.sleep(0.2)
    assert (
        'nats: permissions violation for subscription to "cachepoint.kv.snapshot.serving_llama-1"'
        in {str(e) for e in member0.async_errors}
    )
    reply = await gateway.request("cachepoint.kv.snapshot.serving_llama-0", b"", timeout=2)
    assert reply.data == b"snapshot"
    with pytest.raises(NatsError):
        await gateway.request("cachepoint.kv.snapshot.serving_llama-1", b"", timeout=0.5)
    # The gateway reads; it cannot publish batches or heartbeats itself.
    before = len(received)
    await gateway.publish("cachepoint.replica.heartbeat.serving_llama-0", b"x")
    await nats_settle(gateway)
    await asyncio.sleep(0.2)
    assert len(received) == before
    await member0.close()
    await gateway.close()


async def test_a_user_added_later_takes_effect_on_reload(served: dict[str, Any]) -> None:
    url = served["url"]
    assert await _refused(url, "serving_llama-2", "member2-password-0123456789")
    passwords = {**PASSWORDS, "llama-2": "member2-password-0123456789"}
    users = served["users"] / "nats-users" / "users.conf"
    users.write_text(build_users_conf(member_users("serving", passwords)))
    # What the config reloader does when the mounted file changes: SIGHUP, no restart.
    served["proc"].send_signal(signal.SIGHUP)
    deadline = time.time() + 5
    while await _refused(url, "serving_llama-2", "member2-password-0123456789"):
        assert time.time() < deadline, "the new user was not loaded"
        await asyncio.sleep(0.1)
    assert served["proc"].poll() is None


# ------------------------------------------------------------------ wiring


def test_gateway_and_operator_get_credentials_and_the_url_rule(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["default"]
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    gw = env(gateway["spec"]["template"]["spec"]["containers"][0])
    auth = f"{FULLNAME}-auth"
    assert gw["CACHEPOINT_NATS_USER"] == "gateway"
    assert gw["CACHEPOINT_NATS_PASSWORD"] == {
        "secretKeyRef": {"name": auth, "key": "nats-gateway-password"}
    }
    assert gw["CACHEPOINT_INTERNAL_TOKEN"] == {
        "secretKeyRef": {"name": auth, "key": "internal-token"}
    }
    assert gw["CACHEPOINT_GATEWAY_REPLICA_URL_CHECK"] == "k8s-dns"
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")
    op = env(operator["spec"]["template"]["spec"]["containers"][0])
    assert op["CACHEPOINT_OPERATOR_INTERNAL_TOKEN"] == gw["CACHEPOINT_INTERNAL_TOKEN"]
    assert op["CACHEPOINT_OPERATOR_NATS_USERS_SECRET"] == f"{FULLNAME}-nats-users"
    assert op["CACHEPOINT_OPERATOR_RELEASE_NAMESPACE"] == NAMESPACE
    secret = one(docs, "Secret", auth)["data"]
    values = {k: base64.b64decode(v).decode() for k, v in secret.items()}
    assert set(values) == {"nats-gateway-password", "internal-token"}
    assert all(len(v) >= 32 and v.isalnum() for v in values.values())
    assert values["nats-gateway-password"] != values["internal-token"]


def test_an_existing_auth_secret_replaces_the_generated_one(helm: str) -> None:
    docs = render(helm, "default", "--set", "auth.existingSecret=my-auth")
    assert f"{FULLNAME}-auth" not in objects(docs, "Secret")
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    gw = env(gateway["spec"]["template"]["spec"]["containers"][0])
    assert gw["CACHEPOINT_INTERNAL_TOKEN"]["secretKeyRef"]["name"] == "my-auth"
    nats_c = one(docs, "StatefulSet", f"{FULLNAME}-nats")["spec"]["template"]["spec"]
    raw = env(nats_c["containers"][0])["CACHEPOINT_NATS_GATEWAY_PASSWORD_RAW"]
    assert raw["secretKeyRef"]["name"] == "my-auth"


def test_namespaced_operator_may_touch_only_the_users_secret_in_the_release_namespace(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["gpu-replicas-values"]  # watchNamespaces: [cachepoint]
    role = one(docs, "Role", f"{FULLNAME}-operator-nats-users")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [f"{FULLNAME}-nats-users"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = one(docs, "RoleBinding", f"{FULLNAME}-operator-nats-users")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert f"{FULLNAME}-operator-nats-users" not in objects(rendered["default"], "Role")


def _peers(policy: dict[str, Any], port: str | int) -> list[dict[str, Any]]:
    return [
        peer
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == port for p in rule["ports"])
        for peer in rule.get("from", [])
    ]


def test_network_policies(rendered: dict[str, list[dict[str, Any]]], helm: str) -> None:
    docs = rendered["default"]
    policies = {
        (p["metadata"]["namespace"], n): p for n, p in objects(docs, "NetworkPolicy").items()
    }
    # The replicas' policy is the operator's, one per CacheReplica in its namespace.
    assert set(policies) == {
        (NAMESPACE, f"{FULLNAME}-{c}") for c in ("nats", "gateway", "postgresql")
    }
    gateway_pods = {
        "app.kubernetes.io/name": "cachepoint",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "gateway",
    }
    member_labels = common_labels("any-replica")
    # NATS: the gateway, and replica members from any namespace; nobody else.
    nats_peers = _peers(policies[(NAMESPACE, f"{FULLNAME}-nats")], "client")
    assert nats_peers[0] == {"podSelector": {"matchLabels": gateway_pods}}
    assert nats_peers[1]["namespaceSelector"] == {}
    assert nats_peers[1]["podSelector"]["matchLabels"].items() <= member_labels.items()
    assert len(nats_peers) == 2
    # Replicas: the operator's policy from the chart's settings, in any namespace:
    # selected by the labels the operator puts on members; only the gateway and the
    # operator of this release, from the release namespace.
    operator = one(docs, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    config = OperatorConfig.from_env(
        {k: v for k, v in env(operator["containers"][0]).items() if isinstance(v, str)}
    )
    replicas = build_replica_network_policy(
        replica="any-replica", namespace="team-a", config=config
    )
    assert replicas["spec"]["podSelector"]["matchLabels"].items() <= member_labels.items()
    # ... and scrapers (networkPolicy.metricsFrom, tests/charts/test_gateway_metrics.py).
    *sources, scraper = _peers(replicas, "http")
    assert scraper == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in sources] == [
        "gateway",
        "operator",
    ]
    for peer in sources:
        assert peer["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}
        }
    assert _peers(policies[(NAMESPACE, f"{FULLNAME}-postgresql")], 5432) == [
        {"podSelector": {"matchLabels": gateway_pods}}
    ]
    gateway = policies[(NAMESPACE, f"{FULLNAME}-gateway")]
    assert gateway["spec"]["ingress"][0] == {"ports": [{"port": "http", "protocol": "TCP"}]}
    assert [r["ports"][0]["port"] for r in gateway["spec"]["ingress"]] == ["http", "metrics"]

    # None rendered by the chart in the watched namespaces either: the operator's cover
    # them, as every other namespace (no two policies to keep alike).
    docs = render(helm, "default", "--set", "operator.watchNamespaces={ml-a,ml-b,cachepoint}")
    assert objects_all(docs, "NetworkPolicy", "replicas") == []
    off = render(helm, "default", "--set", "networkPolicy.enabled=false")
    assert objects(off, "NetworkPolicy") == {}
    operator = one(off, "Deployment", f"{FULLNAME}-operator")["spec"]["template"]["spec"]
    assert "CACHEPOINT_OPERATOR_NETWORK_POLICY" not in env(operator["containers"][0])


def objects_all(docs: list[dict[str, Any]], kind: str, component: str) -> list[dict[str, Any]]:
    name = f"{FULLNAME}-{component}"
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
