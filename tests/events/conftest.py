"""A real nats-server that runs with the event plane's generated users and permissions."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachepoint.events.auth import GATEWAY_USER, fleet_users, new_secret, render_authorization

REPLICAS = ("r0", "r1")


class SecureNats:
    """nats-server with ``authorization`` from cachepoint.events.auth: a gateway user
    and one user per replica name, each with its own random password."""

    def __init__(self, tmp: Path, server_class: Any, replicas: tuple[str, ...] = REPLICAS):
        self.passwords = {GATEWAY_USER: new_secret(), **{r: new_secret() for r in replicas}}
        replica_pw = {r: self.passwords[r] for r in replicas}
        self.conf = tmp / "nats.conf"
        self.conf.write_text(
            render_authorization(fleet_users(self.passwords[GATEWAY_USER], replica_pw))
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.server = server_class(port, str(tmp / "nats-store"), str(self.conf))
        self.binary: str = self.server.binary
        self.url: str = self.server.url

    def creds(self, user: str) -> dict[str, str]:
        return {"nats_user": user, "nats_password": self.passwords[user]}

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def secure_nats(tmp_path, nats_server_class) -> Iterator[SecureNats]:
    server = SecureNats(tmp_path, nats_server_class)
    server.start()
    yield server
    server.stop()
