"""The real operator against kmock: member credentials and the NATS users include.

Each CacheReplica gets a credentials Secret (one NATS password per member, plus the
internal token), and the chart's users Secret in the release namespace lists every
member of every CacheReplica, following create, scale and delete.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import kmock

from cachepoint.bench.kube.cluster import (
    INTERNAL_TOKEN,
    NAMESPACE,
    SECRETS,
    USERS_SECRET,
    Cluster,
    cache_replica,
)


def users_in(conf: str) -> dict[str, str]:
    """user -> password (or the $VARIABLE) from a users.conf, read as nats-server would."""
    return dict(re.findall(r'\{user: "([^"]+)", password: ("[^"]*"|\$\w+)', conf))


def users(cluster: Cluster) -> dict[str, str]:
    data = cluster.secret(*USERS_SECRET) or {}
    return {u: p.strip('"') for u, p in users_in(data.get("users.conf", "")).items()}


def member_users(cluster: Cluster) -> dict[str, str]:
    return {u: p for u, p in users(cluster).items() if u != "gateway"}


async def test_members_get_their_own_credentials_and_nats_users(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    creds = await cluster.wait(
        lambda: (
            (cluster.secret(NAMESPACE, "llama-credentials") or {}).keys() >= {"llama-0", "llama-1"}
            and cluster.secret(NAMESPACE, "llama-credentials")
        ),
        "the credentials Secret",
    )
    assert set(creds) == {"llama-0", "llama-1", "internal-token"}
    assert creds["internal-token"] == INTERNAL_TOKEN
    assert creds["llama-0"] != creds["llama-1"]
    assert all(len(creds[p]) >= 24 for p in ("llama-0", "llama-1"))
    cr = cluster.get("llama")
    assert cr is not None
    secret = cluster.server.current(kmock.resource(SECRETS), NAMESPACE, "llama-credentials")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]

    # The users include names each member as its replica process and holds its password;
    # the gateway's password is only a variable nats-server takes from its environment.
    await cluster.wait(lambda: len(member_users(cluster)) == 2, "2 NATS users")
    assert users(cluster) == {
        "gateway": "$CACHEPOINT_NATS_GATEWAY_PASSWORD",
        "serving_llama-0": creds["llama-0"],
        "serving_llama-1": creds["llama-1"],
    }
    conf = (cluster.secret(*USERS_SECRET) or {})["users.conf"]
    assert '"cachepoint.kv.serving_llama-0", "cachepoint.replica.heartbeat.serving_llama-0"' in conf

    # Each member reads its own password and the token from that Secret, by reference.
    pods = await cluster.wait(lambda: len(cluster.pods()) == 2 and cluster.pods(), "2 pods")
    env = {e["name"]: e for e in pods["llama-1"]["spec"]["containers"][0]["env"]}
    assert env["CACHEPOINT_NATS_USER"]["value"] == "serving_llama-1"
    assert env["CACHEPOINT_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "llama-credentials",
        "key": "llama-1",
    }
    assert env["CACHEPOINT_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "llama-credentials",
        "key": "internal-token",
    }
    assert env["CACHEPOINT_NATS_URL"]["value"] == "nats://cachepoint-nats:4222"
    assert (
        env["CACHEPOINT_REPLICA_ADVERTISE_URL"]["value"]
        == "http://llama-1.llama.serving.svc.cluster.local:8100"
    )
    assert all("PASSWORD" not in e["name"] or "value" not in e for e in env.values())


async def test_scaling_adds_and_drops_users_and_keeps_passwords(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=1))
    await cluster.wait(lambda: set(member_users(cluster)) == {"serving_llama-0"}, "1 user")
    first = member_users(cluster)["serving_llama-0"]

    await cluster.patch("llama", {"spec": {"replicas": 3}}, sub="scale")
    await cluster.wait(lambda: len(member_users(cluster)) == 3, "3 users")
    assert member_users(cluster)["serving_llama-0"] == first  # the member that stays keeps it
    assert set(cluster.secret(NAMESPACE, "llama-credentials") or {}) == {
        "llama-0",
        "llama-1",
        "llama-2",
        "internal-token",
    }

    await cluster.patch("llama", {"spec": {"replicas": 1}}, sub="scale")
    await cluster.wait(lambda: set(member_users(cluster)) == {"serving_llama-0"}, "back to 1")
    assert member_users(cluster)["serving_llama-0"] == first
    assert set(cluster.secret(NAMESPACE, "llama-credentials") or {}) == {
        "llama-0",
        "internal-token",
    }


async def test_deleting_one_cache_replica_keeps_the_others_users(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.create(cache_replica("qwen", replicas=1))
    both = {"serving_llama-0", "serving_llama-1", "serving_qwen-0"}
    await cluster.wait(lambda: set(member_users(cluster)) == both, "users of both")
    record = json.loads((cluster.secret(*USERS_SECRET) or {})["members.json"])
    assert set(record) == {"serving/llama", "serving/qwen"}

    await cluster.delete("llama")
    await cluster.wait(lambda: cluster.get("llama") is None, "llama gone")
    assert set(member_users(cluster)) == {"serving_qwen-0"}
    assert cluster.secret(NAMESPACE, "llama-credentials") is None
    assert cluster.secret(NAMESPACE, "qwen-credentials") is not None


async def test_a_reset_users_secret_is_rebuilt_by_the_timer(
    cluster: Cluster, operator: Any
) -> None:
    await cluster.create(cache_replica("llama", replicas=2))
    await cluster.wait(lambda: len(member_users(cluster)) == 2, "2 users")
    before = member_users(cluster)
    # What a `helm upgrade` rendering the Secret from scratch would leave: no members.
    gateway_only = (
        'users = [\n  {user: "gateway", password: $CACHEPOINT_NATS_GATEWAY_PASSWORD}\n]\n'
    )
    reset = {
        "data": {
            "users.conf": base64.b64encode(gateway_only.encode()).decode(),
            "members.json": base64.b64encode(b"{}").decode(),
        }
    }
    namespace, name = USERS_SECRET
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    headers = {"Content-Type": "application/merge-patch+json"}
    response = await cluster.server.patch(path, data=json.dumps(reset), headers=headers)
    assert response.status == 200, await response.text()
    assert member_users(cluster) == {}
    await cluster.wait(lambda: member_users(cluster) == before, "the users put back")
