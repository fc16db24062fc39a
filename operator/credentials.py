"""Apply the credentials builders: each CacheReplica's Secret and the NATS users include.

Both are level-based: every reconcile and every timer tick asserts the current state,
so a missed event (an operator restart, a Helm upgrade that reset the users Secret) is
repaired on the next tick rather than lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from cachepoint.operator import kube
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.naming import USERS_RECORD_KEY, credentials_secret_name
from cachepoint.operator.nats_auth import (
    MemberCredentials,
    build_credentials_secret,
    build_users_data,
    decode_secret,
    live_record_keys,
    member_passwords,
    member_users,
    merge_record,
    new_password,
    parse_record,
    prune_record,
    record_key,
)

CONFLICT_ATTEMPTS = 5  # re-reads of the users Secret when another writer got there first


class ForeignSecret(Exception):
    """A Secret with the credentials name exists and is not this CacheReplica's."""


def ensure_credentials(
    owner: kopf.Body,
    replica: str,
    namespace: str,
    replicas: int,
    config: OperatorConfig,
    make: Callable[[], str] = new_password,
) -> dict[str, str]:
    """Create or update the CacheReplica's credentials Secret; its members' passwords.

    The handlers and the timer may both get here at once (a scale-up while a tick runs):
    writes are conditional, and the loser reads the winner's passwords and uses those,
    so the users include never gets a password the members' Secret does not have.
    """
    name = credentials_secret_name(replica)
    token = config.internal_token.get_secret_value() if config.internal_token else None
    for attempt in range(CONFLICT_ATTEMPTS):
        current = kube.get_secret(namespace, name)
        if current is not None and not kube.owned_by(current, owner.metadata.uid or ""):
            raise ForeignSecret(f"Secret {name} already exists and is not this CacheReplica's")
        credentials = MemberCredentials(
            passwords=member_passwords(replica, replicas, decode_secret(current), make),
            internal_token=token,
        )
        desired = build_credentials_secret(
            replica=replica, namespace=namespace, credentials=credentials
        )
        kopf.adopt(desired, owner=owner)
        if current is None:
            if kube.create_secret(desired):
                return credentials.passwords
            continue  # created meanwhile: take its passwords
        if current.get("data") == desired["data"]:
            return credentials.passwords
        try:
            kube.patch_secret(namespace, name, _conditional(current, desired["data"]))
            return credentials.passwords
        except ApiException as e:
            if e.status not in (409, 422) or attempt == CONFLICT_ATTEMPTS - 1:
                raise
    raise kopf.TemporaryError(f"Secret {name} keeps changing under us")


def _conditional(current: dict[str, Any], data: dict[str, str]) -> list[dict[str, Any]]:
    """JSON patch replacing `data` only if nobody wrote the object since we read it."""
    version = current["metadata"].get("resourceVersion")
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": version},
        {"op": "replace", "path": "/data", "value": data},
    ]


def sync_nats_users(
    config: OperatorConfig, namespace: str, replica: str, passwords: dict[str, str] | None
) -> bool:
    """Put one CacheReplica's users into the NATS users Secret (None removes them).

    Whether the Secret changed.
    """
    key = record_key(namespace, replica)
    users = member_users(namespace, passwords) if passwords else None
    return _rewrite_users(config, lambda record: merge_record(record, key, users))


def prune_nats_users(config: OperatorConfig) -> bool:
    """Drop the users of every CacheReplica that is gone or being deleted.

    Whether the Secret changed. Only the namespaces the record names are listed, each
    on its own: the operator's Roles (watchNamespaces) or ClusterRole (all namespaces)
    allow exactly that, and a namespace it may not list (403) is no longer one it
    manages, so its users go too.
    """
    return _rewrite_users(config, _without_gone)


def _without_gone(record: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    existing: set[str] = set()
    for namespace in sorted({key.partition("/")[0] for key in record}):
        try:
            existing |= live_record_keys(kube.list_cache_replicas(namespace))
        except ApiException as e:
            if e.status != 403:
                raise  # anything else: prune nothing this time
    return prune_record(record, existing)


def _rewrite_users(
    config: OperatorConfig,
    change: Callable[[dict[str, dict[str, str]]], dict[str, dict[str, str]]],
) -> bool:
    """Read the NATS users Secret, apply `change` to its record, write it back if changed.

    A conditional patch (resourceVersion) keeps concurrent writers from overwriting each
    other: on a conflict, read and apply `change` again. NOTE: `change` runs after each
    read, so whatever it looks up (the CacheReplicas that exist) is at least as new as
    the record it edits: a CacheReplica whose users are in the record we read existed
    before we listed, and one added later bumps the resourceVersion and fails the patch.
    """
    if not config.maintains_nats_users:
        return False
    assert config.release_namespace and config.nats_users_secret
    ns, name = config.release_namespace, config.nats_users_secret
    for attempt in range(CONFLICT_ATTEMPTS):
        current = kube.get_secret(ns, name)
        record = change(parse_record(decode_secret(current).get(USERS_RECORD_KEY)))
        data = build_users_data(record)
        if current is None:
            if not record:
                return False
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": ns},
                "type": "Opaque",
                "data": data,
            }
            if kube.create_secret(secret):
                return True
            continue  # created by someone else meanwhile: merge into theirs
        if current.get("data") == data:
            return False
        try:
            kube.patch_secret(ns, name, _conditional(current, data))
            return True
        except ApiException as e:
            if e.status not in (409, 422) or attempt == CONFLICT_ATTEMPTS - 1:
                raise
    return False


def remove_credentials(namespace: str, replica: str, uid: str) -> int:
    """Delete the CacheReplica's credentials Secret if it is ours; how many went."""
    name = credentials_secret_name(replica)
    current = kube.get_secret(namespace, name)
    if current is not None and kube.owned_by(current, uid):
        return int(kube.delete_secret(namespace, name))
    return 0
