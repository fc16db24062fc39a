"""The embedded stack's secrets: one NATS password per process and the internal token.

Generated afresh at every start and written under the state folder, readable by the
owner only: ``nats.conf`` (the server's users and per-subject permissions) and
``secrets.json`` (the same passwords and the token, for scripts and debugging).
Children get theirs in the environment, never on a command line (``ps`` shows those).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachepoint.events.auth import GATEWAY_USER, fleet_users, new_secret, render_authorization

NATS_CONF = "nats.conf"
SECRETS_JSON = "secrets.json"


def _write_private(path: Path, text: str) -> None:
    # NOTE: created 0600, not chmod-ed after: the file never exists readable by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file keeps its mode through O_TRUNC: tighten first
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


@dataclass(slots=True, frozen=True)
class StackCredentials:
    """Who may do what on the stack's event plane and replica API."""

    nats: dict[str, str]  # NATS user -> password: "gateway" and each replica's name
    internal_token: str  # the gateway's bearer token for the replicas' internal API

    @classmethod
    def generate(cls, replicas: Iterable[str]) -> StackCredentials:
        users = {GATEWAY_USER: new_secret(), **{r: new_secret() for r in replicas}}
        return cls(users, new_secret())

    def nats_config(self) -> str:
        replicas = {u: pw for u, pw in self.nats.items() if u != GATEWAY_USER}
        return render_authorization(fleet_users(self.nats[GATEWAY_USER], replicas))

    def write(self, state_dir: Path) -> Path:
        """Write nats.conf and secrets.json (0600); returns nats.conf's path."""
        conf = state_dir / NATS_CONF
        _write_private(conf, self.nats_config())
        body = {"nats": self.nats, "internal_token": self.internal_token}
        _write_private(state_dir / SECRETS_JSON, json.dumps(body, indent=2) + "\n")
        return conf

    def env_for(self, child: str) -> dict[str, str]:
        """The environment entries of one child: its NATS login (the gateway's, or the
        replica's own, named like the child) and the internal token."""
        if child not in self.nats:
            return {}  # nats-server itself reads nats.conf
        return {
            "CACHEPOINT_NATS_USER": child,
            "CACHEPOINT_NATS_PASSWORD": self.nats[child],
            "CACHEPOINT_INTERNAL_TOKEN": self.internal_token,
        }
