"""NATS subjects (contract §4). Replica names are single subject tokens."""

from __future__ import annotations

import re

KV_PREFIX = "cachepoint.kv"
KV_ALL = f"{KV_PREFIX}.*"  # one token after the prefix: never matches snapshot subjects
SNAPSHOT_ALL = f"{KV_PREFIX}.snapshot.*"
# NOTE: one heartbeat subject per replica, so a NATS permission can bind a replica's
# credentials to the only name it may announce.
HEARTBEAT = "cachepoint.replica.heartbeat"
HEARTBEAT_ALL = f"{HEARTBEAT}.*"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_replica_name(name: str) -> str:
    """Replica names become subject tokens: letters, digits, '-' and '_' only."""
    if not _TOKEN.match(name) or name == "snapshot":
        raise ValueError(
            f"replica name {name!r} must be 1-64 letters, digits, '-' or '_' (and not 'snapshot')"
        )
    return name


def kv_subject(replica: str) -> str:
    return f"{KV_PREFIX}.{replica}"


def snapshot_subject(replica: str) -> str:
    return f"{KV_PREFIX}.snapshot.{replica}"


def heartbeat_subject(replica: str) -> str:
    return f"{HEARTBEAT}.{replica}"


def subject_replica(subject: str) -> str:
    """The replica a kv or heartbeat subject belongs to: its last token."""
    return subject.rsplit(".", 1)[-1]
