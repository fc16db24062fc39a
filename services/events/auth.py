"""NATS credentials and per-subject permissions for the event plane (pure builders).

Each replica connects as a user named after itself and may publish only its own kv
batches and heartbeats and answer only its own snapshot requests; the gateway may
only listen and ask for snapshots. Nobody connects without a password (no
``no_auth_user``). The embedded stack and the Helm chart render the server's
``authorization`` block from these same rules.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cachepoint.events.subjects import (
    HEARTBEAT_ALL,
    KV_ALL,
    SNAPSHOT_ALL,
    check_replica_name,
    heartbeat_subject,
    kv_subject,
    snapshot_subject,
)

GATEWAY_USER = "gateway"
INBOX_ALL = "_INBOX.>"  # where nats-py's request() waits for replies


@dataclass(slots=True, frozen=True)
class NatsUser:
    """One entry of the server's ``authorization.users`` list."""

    user: str  # the login; a replica's is its replica name
    password: str  # plain text, as the client sends it
    publish: tuple[str, ...]  # subjects it may publish to
    subscribe: tuple[str, ...]  # subjects it may subscribe to
    allow_responses: bool = False  # may reply to requests it received


def new_secret() -> str:
    """A random password or token: 32 bytes, URL-safe (no quoting trouble anywhere)."""
    return secrets.token_urlsafe(32)


def replica_user(name: str, password: str) -> NatsUser:
    check_replica_name(name)
    if name == GATEWAY_USER:
        raise ValueError(f"a replica may not be named {GATEWAY_USER!r}: that is the gateway's user")
    return NatsUser(
        user=name,
        password=password,
        publish=(kv_subject(name), heartbeat_subject(name)),
        subscribe=(snapshot_subject(name),),
        allow_responses=True,  # answers the gateway's snapshot requests
    )


def gateway_user(password: str) -> NatsUser:
    return NatsUser(
        user=GATEWAY_USER,
        password=password,
        publish=(SNAPSHOT_ALL,),
        subscribe=(KV_ALL, HEARTBEAT_ALL, INBOX_ALL),
    )


def fleet_users(gateway_password: str, replica_passwords: Mapping[str, str]) -> list[NatsUser]:
    """The gateway's user and one per replica (name -> password)."""
    return [gateway_user(gateway_password)] + [
        replica_user(name, pw) for name, pw in sorted(replica_passwords.items())
    ]


def _q(s: str) -> str:
    # NOTE: the NATS config parser reads JSON-style double-quoted strings, and an
    # unquoted subject with '*' or '>' or a password with '$' would be misread.
    return json.dumps(s)


def _list(subjects: Iterable[str]) -> str:
    return "[" + ", ".join(_q(s) for s in subjects) + "]"


def render_authorization(users: Iterable[NatsUser]) -> str:
    """The ``authorization { users = [...] }`` block of a nats-server config."""
    lines = ["authorization {", "  users = ["]
    for u in users:
        lines += [
            "    {",
            f"      user: {_q(u.user)}",
            f"      password: {_q(u.password)}",
            "      permissions {",
            f"        publish {{ allow: {_list(u.publish)} }}",
            f"        subscribe {{ allow: {_list(u.subscribe)} }}",
        ]
        if u.allow_responses:
            lines.append("        allow_responses: true")
        lines += ["      }", "    }"]
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"
