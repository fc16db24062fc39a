"""`cachepoint up` as a newcomer runs it: real processes, real NATS, the SDK demo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

CMD = [sys.executable, "-m", "cachepoint.embedded.cli", "up"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.slow
def test_up_demo_end_to_end(tmp_path, free_port):
    port = free_port()
    state = tmp_path / "state"
    r = subprocess.run(
        [
            *CMD,
            "--state-dir",
            str(state),
            "--port",
            str(port),
            "--demo",
            "--turns",
            "4",
            "--exit-after-demo",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Cachepoint is up" in r.stdout
    assert "saved" in r.stdout
    ep = json.loads((state / "endpoint.json").read_text())
    assert set(ep) >= {"base_url", "api_key", "admin_key", "org", "nats_url", "db_url", "replicas"}
    assert len(ep["replicas"]) == 2
    assert ep["api_key"] in r.stdout
    time.sleep(0.5)
    assert not [n for n, pid in ep["pids"].items() if _alive(pid)], "orphan processes left"


def _as_if_backgrounded() -> None:
    """What a non-interactive shell does to a job it starts with `&`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _wait_for_endpoint(proc: subprocess.Popen[str], state) -> None:
    """Until `cachepoint up` has written endpoint.json (it is serving by then)."""
    deadline = time.time() + 180
    while not (state / "endpoint.json").exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.time() < deadline
        time.sleep(0.2)


def _say(ep: dict, text: str) -> None:
    r = httpx.post(
        f"{ep['base_url']}/v1/messages",
        headers={"x-api-key": ep["api_key"]},
        json={
            "model": "cachepoint-tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": text}],
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _endpoint(state) -> dict:
    # NOTE: endpoint.json is replaced whole on each restart; read until it parses.
    for _ in range(50):
        try:
            return json.loads((state / "endpoint.json").read_text())
        except (ValueError, FileNotFoundError):
            time.sleep(0.1)
    raise AssertionError("endpoint.json unreadable")


@pytest.mark.slow
def test_up_restarts_a_killed_replica_and_nats(tmp_path, free_port):
    """kill -9 of a replica or of nats-server used to stop the whole stack. Started as a
    non-interactive shell starts a job with `&` (SIGINT inherited ignored), the Ctrl-C
    at the end must still stop it: `cachepoint up` installs its own SIGINT handler."""
    port = free_port()
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [*CMD, "--state-dir", str(state), "--port", str(port), "--replicas", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # Ctrl-C below goes to the group, as a terminal's does
        preexec_fn=_as_if_backgrounded,
    )
    pids: set[int] = set()
    try:
        _wait_for_endpoint(proc, state)
        first = _endpoint(state)
        pids |= set(first["pids"].values())
        os.kill(first["pids"]["replica-0"], signal.SIGKILL)
        os.kill(first["pids"]["nats"], signal.SIGKILL)
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, "cachepoint up exited after a child died"
            ep = _endpoint(state)
            pids |= set(ep["pids"].values())
            body = {}
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = httpx.get(f"{ep['base_url']}/readyz", timeout=2).json()
            if (
                ep["pids"]["replica-0"] != first["pids"]["replica-0"]
                and ep["pids"]["nats"] != first["pids"]["nats"]
                and body.get("replicas_live") == 1
                and body.get("event_plane") == "connected"
            ):
                break
            assert time.time() < deadline, body
            time.sleep(0.3)
        _say(ep, "still there?")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for name in ("replica-0", "nats"):
        assert f"{name} (pid {first['pids'][name]}) died (SIGKILL)" in out, out
        assert f"{name} restarted (restart #1" in out, out
    log = [json.loads(x) for x in (state / "logs" / "supervisor.log").read_text().splitlines()]
    # Only the two kills: the Ctrl-C stopped the rest in order, with no deaths to report.
    died = sorted((e["child"], e["signal"]) for e in log if e["event"] == "exited")
    assert died == [("nats", "SIGKILL"), ("replica-0", "SIGKILL")], log
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "orphan processes left"


def test_up_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [*CMD, "--state-dir", str(tmp_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"port {port} is already in use" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_up_help_documents_the_flags():
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--replicas", "--model-dir", "--port", "--demo", "--kv-host-bytes"):
        assert flag in out
