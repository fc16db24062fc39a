"""The embedded stack's state folder is private: the folder and its
subfolders 0700, every file 0600 (the ledger holds stored response bodies and key
digests, the logs request lines, secrets.json the passwords), an older run's
world-readable folder tightened on start."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cachepoint.embedded.stack import Stack
from cachepoint.embedded.supervise import Supervisor

from ..conftest import _free_port


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The usual 022, so that anything not made private on purpose is group/world
    readable and the checks below catch it."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) with a group or other bit."""
    found = []
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_IMODE(st.st_mode) & 0o077:
            found.append(f"{path.relative_to(root.parent)} {stat.S_IMODE(st.st_mode):o}")
    return found


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.usefixtures("loose_umask")
def test_cachepoint_up_state_is_private_and_an_old_folder_is_tightened(tmp_path):
    state = tmp_path / ".cachepoint"
    # What an older run left: a world-readable folder, log and ledger.
    (state / "logs").mkdir(parents=True, mode=0o755)
    (state / "traces").mkdir(mode=0o755)
    (state / "logs" / "gateway.log").write_text("an older run's request lines\n")
    (state / "cachepoint.db").touch(mode=0o644)
    (state / "endpoint.json").write_text("{}\n")
    assert _open_to_others(state)
    stack = Stack(state, replicas=1, port=_free_port(), tracing=True)
    stack.start()
    try:
        r = httpx.post(
            f"{stack.base_url}/v1/messages",
            headers={"x-api-key": stack.keys["api_key"]},
            json={
                "model": stack.served_model(),
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        # The gateway's spans reach their file within its export interval.
        deadline = time.time() + 20
        while not any((state / "traces").rglob("*")) and time.time() < deadline:
            time.sleep(0.2)
        files = _files(state)
        # What the stack writes: ledger (SQLite's own -wal/-shm, by several processes),
        # secrets, endpoint, each child's log, span files.
        assert {"cachepoint.db", "secrets.json", "nats.conf", "endpoint.json"} <= files
        assert {"logs/gateway.log", "logs/nats.log", "logs/replica-0.log"} <= files
        assert any(f.startswith("traces/") for f in files), files
        assert _open_to_others(state) == []
    finally:
        stack.stop()
    assert _open_to_others(state) == []
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


@pytest.mark.usefixtures("loose_umask")
def test_supervisor_log_is_created_private(tmp_path):
    log = tmp_path / "supervisor.log"
    sup = Supervisor(lambda: [], lambda _: None, log, threading.Lock())
    sup._log({"event": "exited"})
    sup._log({"event": "restarted"})
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert log.read_text().count("\n") == 2
    # An older, readable one is tightened at its next line.
    log.chmod(0o644)
    sup._log({"event": "exited"})
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
