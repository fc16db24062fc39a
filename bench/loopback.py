"""A gateway over the echo replica on loopback, as the gateway benches and their tests
run it: a seeded SQLite ledger, the two processes, readiness, and the kernel's view of
a process's memory (``/proc/PID/status``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from cachepoint.embedded.stack import free_port
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_key, create_org

ECHO_APP = "cachepoint.replica.echo:create_echo_app"


def seed_orgs(db: str, names: Sequence[str]) -> dict[str, str]:
    """Migrate ``db`` and make one org with one API key per name: name -> key."""
    engine = make_engine(db)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        keys = {name: create_key(s, create_org(s, name))[1] for name in names}
        s.commit()
    engine.dispose()
    return keys


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became ready")


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` figure in KiB (VmRSS, VmHWM: the peak since a reset)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS ("5" to clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class Loopback:
    gateway_url: str
    replica_url: str
    gateway_pid: int


@contextmanager
def echo_gateway(
    db: str,
    log_dir: Path,
    gateway_args: Sequence[str] = (),
    gateway_env: dict[str, str] | None = None,
) -> Iterator[Loopback]:
    """The echo replica and a gateway in front of it (``gateway_args`` added to its
    command line, ``gateway_env`` to its environment), stopped on exit. The gateway's
    request log goes to ``log_dir/gateway.log``, as in the embedded stack."""
    rport, gport = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    uvicorn = [sys.executable, "-m", "uvicorn", "--factory", ECHO_APP, "--port", str(rport)]
    replica = subprocess.Popen([*uvicorn, "--log-level", "warning"], env=env)
    rurl, gurl = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{gport}"
    args = ["--port", str(gport), "--db", db, "--replica", rurl, *gateway_args]
    with (log_dir / "gateway.log").open("wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "cachepoint.gateway.cli", *args, "--log-level", "warning"],
            env={**env, **(gateway_env or {})},
            stderr=log,
        )
    try:
        wait_ready(rurl, replica)
        wait_ready(gurl, gateway)
        yield Loopback(gurl, rurl, gateway.pid)
    finally:
        for p in (gateway, replica):
            p.terminate()
            p.wait(10)
