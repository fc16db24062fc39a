"""Pure builders for event-plane credentials: member Secrets and the NATS users include.

Each member pod gets its own NATS user, named like the replica process
(`<namespace>_<pod>`), whose permissions let it publish only its own kv batches and
heartbeats and answer only its own snapshot requests. The gateway's user is the same in
every build; its password stays in the NATS container's environment (see naming.py).
Randomness comes in as a function, so the same inputs always give the same output.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cachepoint.operator.naming import (
    GATEWAY_NATS_USER,
    GATEWAY_PASSWORD_ENV,
    INTERNAL_TOKEN_KEY,
    USERS_CONF_KEY,
    USERS_RECORD_KEY,
    common_labels,
    credentials_secret_name,
    member_pod_name,
    replica_process_name,
)

# The shapes nats-server's config parser takes inside quotes without escapes: user names
# are subject tokens, passwords are what new_password() makes (URL-safe base64).
_USER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PASSWORD = re.compile(r"^[A-Za-z0-9_-]{16,128}$")

# The gateway reads every replica's batches and heartbeats and asks any replica for a
# snapshot; replies come back on its inbox.
GATEWAY_PERMISSIONS: dict[str, Any] = {
    "publish": {"allow": ["cachepoint.kv.snapshot.*"]},
    "subscribe": {"allow": ["cachepoint.kv.*", "cachepoint.replica.heartbeat.*", "_INBOX.>"]},
}


def new_password() -> str:
    return secrets.token_urlsafe(24)


def replica_permissions(user: str) -> dict[str, Any]:
    """A replica may speak only under its own name (contract §4, NATS permissions)."""
    return {
        "publish": {"allow": [f"cachepoint.kv.{user}", f"cachepoint.replica.heartbeat.{user}"]},
        "subscribe": {"allow": [f"cachepoint.kv.snapshot.{user}"]},
        # Lets it publish the reply to a snapshot request (on the requester's inbox)
        # without any general publish right on _INBOX.>.
        "allow_responses": True,
    }


@dataclass(frozen=True, slots=True)
class MemberCredentials:
    """What one CacheReplica's credentials Secret holds, decoded."""

    passwords: dict[str, str]  # member pod name -> its NATS password
    internal_token: str | None  # the replicas' shared token, None when none is configured


def member_passwords(
    replica: str, replicas: int, existing: Mapping[str, str], make: Callable[[], str]
) -> dict[str, str]:
    """One password per member 0..replicas-1: kept when already there, made when not.

    A member replaced by a roll keeps its name and so its password; members beyond the
    count lose theirs (their pods are deleted).
    """
    result = {}
    for index in range(replicas):
        pod = member_pod_name(replica, index)
        current = existing.get(pod)
        result[pod] = current if current and _PASSWORD.match(current) else make()
    return result


def decode_secret(secret: dict[str, Any] | None) -> dict[str, str]:
    data = (secret or {}).get("data") or {}
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def build_credentials_secret(
    *, replica: str, namespace: str, credentials: MemberCredentials
) -> dict[str, Any]:
    values = dict(credentials.passwords)
    if credentials.internal_token is not None:
        values[INTERNAL_TOKEN_KEY] = credentials.internal_token
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": credentials_secret_name(replica),
            "namespace": namespace,
            "labels": common_labels(replica),
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(values.items())},
    }


def member_users(namespace: str, passwords: Mapping[str, str]) -> dict[str, str]:
    """NATS user -> password for one CacheReplica's members (users are process names)."""
    return {replica_process_name(namespace, pod): pw for pod, pw in passwords.items()}


def _entry(user: str, password: str, permissions: dict[str, Any], *, literal: bool) -> str:
    if not _USER.match(user):
        raise ValueError(f"NATS user {user!r} is not a subject token")
    if literal and not _PASSWORD.match(password):
        raise ValueError(f"password for {user!r} has characters the users file cannot hold")
    secret = json.dumps(password) if literal else password
    perms = json.dumps(permissions, separators=(", ", ": "))
    return f"  {{user: {json.dumps(user)}, password: {secret}, permissions: {perms}}}"


def build_users_conf(users: Mapping[str, str]) -> str:
    """The `users = [...]` include for nats-server's authorization block.

    Always the gateway first (its password a variable nats-server takes from its env),
    then every replica user in name order, so equal inputs give byte-equal files and
    the config reloader sees a change only when a user really changed.
    """
    gateway = f"${GATEWAY_PASSWORD_ENV}"
    lines = [_entry(GATEWAY_NATS_USER, gateway, GATEWAY_PERMISSIONS, literal=False)]
    for user in sorted(users):
        if user == GATEWAY_NATS_USER:
            raise ValueError(f"a replica cannot be named {GATEWAY_NATS_USER!r}")
        lines.append(_entry(user, users[user], replica_permissions(user), literal=True))
    header = "# Written by cachepoint-operator from every CacheReplica's members: do not edit.\n"
    return header + "users = [\n" + "\n".join(lines) + "\n]\n"


def record_key(namespace: str, replica: str) -> str:
    return f"{namespace}/{replica}"


def merge_record(
    record: Mapping[str, Mapping[str, str]], key: str, users: Mapping[str, str] | None
) -> dict[str, dict[str, str]]:
    """The record with one CacheReplica's users replaced (or removed, with None)."""
    merged = {k: dict(v) for k, v in record.items() if k != key}
    if users:
        merged[key] = dict(users)
    return merged


def live_record_keys(cache_replicas: Iterable[Mapping[str, Any]]) -> set[str]:
    """Record keys of the CacheReplicas that may hold NATS users: not being deleted."""
    keys = set()
    for obj in cache_replicas:
        meta = obj.get("metadata") or {}
        if meta.get("name") and meta.get("namespace") and not meta.get("deletionTimestamp"):
            keys.add(record_key(meta["namespace"], meta["name"]))
    return keys


def prune_record(
    record: Mapping[str, Mapping[str, str]], existing_keys: Collection[str]
) -> dict[str, dict[str, str]]:
    """The record without the users of CacheReplicas that no longer exist.

    NOTE: merging one CacheReplica at a time cannot remove users for sure (a timer tick
    that began before a deletion writes them back after the delete handler dropped them;
    a finalizer removed by hand skips that handler): this level-based pass does.
    """
    return {k: dict(v) for k, v in record.items() if k in existing_keys}


def flatten(record: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    return {user: pw for users in record.values() for user, pw in users.items()}


def build_users_data(record: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The users Secret's data (base64) for a record of every CacheReplica's users."""
    values = {
        USERS_CONF_KEY: build_users_conf(flatten(record)),
        USERS_RECORD_KEY: json.dumps(record, sort_keys=True, separators=(",", ":")),
    }
    return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}


def parse_record(text: str | None) -> dict[str, dict[str, str]]:
    """The record from the Secret; an unreadable one starts empty (rebuilt by the timers)."""
    try:
        data = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): {str(u): str(p) for u, p in v.items()}
        for k, v in data.items()
        if isinstance(v, dict)
    }
