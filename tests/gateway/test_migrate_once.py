"""db/migrate.py: gateway pods starting together migrate once, after the database answers.

Against the real PostgreSQL at 127.0.0.1:5432 (the db_url fixture's server).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import inspect, text

from cachepoint.gateway.db.migrate import DatabaseUnreachable, upgrade
from cachepoint.gateway.db.session import make_engine

from .conftest import postgres_database

# One gateway pod's start, as a process of its own: connect, say "ready", wait for
# "go" on stdin (so both start migrating at the same moment), migrate, print the DDL
# statements it ran.
MIGRATOR = """
import json, sys
from sqlalchemy import event
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine

engine = make_engine(sys.argv[1])
ddl = []

@event.listens_for(engine, "before_cursor_execute")
def record(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith(("CREATE", "ALTER", "DROP")):
        ddl.append(" ".join(statement.split()[:3]))

with engine.connect():
    pass
print("ready", flush=True)
sys.stdin.readline()
upgrade(engine, wait_s=10)
print(json.dumps(ddl), flush=True)
"""


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database("cp_migrate") as url:
        yield url


def test_two_concurrent_migrators_both_succeed_and_migrate_once(pg_url: str) -> None:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATOR, pg_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    ddl = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    # One created the schema; the other waited on the lock, found it at head, ran no DDL.
    assert sorted(map(len, ddl))[0] == 0, ddl
    made = max(ddl, key=len)
    assert "CREATE TABLE alembic_version" in made

    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
        assert len(versions) == 1
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    # Every table the migrations create is there, each made exactly once.
    created = [s.split()[2].strip('"') for s in made if s.upper().startswith("CREATE TABLE")]
    assert len(created) == len(set(created))
    assert set(created) == tables


def test_a_second_upgrade_is_a_no_op(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(pg_url)
    try:
        with caplog.at_level(logging.INFO, logger="cachepoint.gateway.db"):
            upgrade(engine)
            upgrade(engine)
    finally:
        engine.dispose()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("database schema migrated from empty to ") for line in lines)
    assert lines[-1].startswith("database schema already at ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_database_fails_clearly_after_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine(f"postgresql+psycopg://postgres:hunter2@127.0.0.1:{free_port()}/x")
    started = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger="cachepoint.gateway.db"),
        pytest.raises(DatabaseUnreachable) as raised,
    ):
        upgrade(engine, wait_s=1.2)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 10
    message = str(raised.value)
    assert "not reachable after" in message and "in 1.2 s" in message
    assert "hunter2" not in message  # the URL is logged without its password
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) >= 2
    assert "(attempt 1)" in retries[0]
    assert all("hunter2" not in line for line in retries)


def _forward_later(port: int, delay: float, stop: threading.Event) -> None:
    """After ``delay`` seconds, listen on ``port`` and relay each connection to 5432:
    a database that comes up while the gateway waits."""

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            dst.close()

    time.sleep(delay)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", 5432))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()


def test_waits_for_a_database_that_comes_up_then_migrates(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    stop = threading.Event()
    relay = threading.Thread(target=_forward_later, args=(port, 1.0, stop), daemon=True)
    relay.start()
    engine = make_engine(pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}"))
    try:
        with caplog.at_level(logging.INFO, logger="cachepoint.gateway.db"):
            upgrade(engine, wait_s=30)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        engine.dispose()
        stop.set()
        relay.join(timeout=5)
    lines = [r.getMessage() for r in caplog.records]
    assert any("not reachable (attempt 1)" in line for line in lines)
    assert any("reachable after" in line for line in lines)
