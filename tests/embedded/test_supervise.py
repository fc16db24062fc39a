"""The embedded stack survives its parts: a dead child is restarted with backoff and
reported, and stop() leaves nothing behind, not even a restart in progress."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import anthropic
import httpx
import pytest

from cachepoint.embedded.stack import Stack
from cachepoint.embedded.supervise import Backoff, Supervisor

from .test_up import _alive


@dataclass
class FakeChild:
    """A child whose exit the test decides; respawn gives it a new pid."""

    name: str
    pid: int = 100
    code: int | None = None
    started_at: float = 0.0
    restarts: int = 0
    in_a_row: int = 0
    restart_at: float | None = None
    spawned: list[int] = field(default_factory=list)

    def returncode(self) -> int | None:
        return self.code


def _supervisor(tmp_path, children, backoff=None):
    def respawn(child):
        child.pid += 1
        child.code = None
        child.spawned.append(child.pid)

    events = []
    sup = Supervisor(
        lambda: children,
        respawn,
        tmp_path / "supervisor.log",
        threading.Lock(),
        backoff=backoff or Backoff(0.5, 4.0, 60.0),
        on_event=events.append,
    )
    return sup, events


def _log(tmp_path):
    return [json.loads(line) for line in (tmp_path / "supervisor.log").read_text().splitlines()]


def test_backoff_doubles_to_the_cap():
    b = Backoff(0.5, 30.0, 60.0)
    assert [b.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_a_crash_loop_backs_off_and_a_long_run_resets_it(tmp_path):
    child = FakeChild("replica-0")
    sup, events = _supervisor(tmp_path, [child])
    now = 0.0
    delays = []
    for _ in range(5):
        child.code = -signal.SIGKILL
        sup.tick(now)  # seen dead: a restart is scheduled
        delays.append(child.restart_at - now)
        sup.tick(now + delays[-1] - 0.01)  # not yet
        assert child.spawned == list(range(101, 101 + len(delays) - 1))
        now += delays[-1]
        child.started_at = now
        sup.tick(now)  # due: spawned again
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert child.restarts == 5
    # Up for a minute: the next death starts from the first delay again.
    child.started_at = now
    sup.tick(now + 60)
    child.code = 1
    sup.tick(now + 61)
    assert child.restart_at - (now + 61) == 0.5
    lines = _log(tmp_path)
    assert [ln["event"] for ln in lines[:2]] == ["exited", "restarted"]
    assert lines[0] == {
        **lines[0],
        "child": "replica-0",
        "signal": "SIGKILL",
        "exit_code": None,
        "restart": 1,
        "backoff_s": 0.5,
        "pid": 100,
    }
    assert lines[-1]["exit_code"] == 1 and lines[-1]["signal"] is None
    assert lines[-1]["restart"] == 6
    assert [e.event for e in events] == [ln["event"] for ln in lines]
    assert "died (SIGKILL); restart #1 in 0.5s" in events[0].describe()


def test_a_restart_that_cannot_spawn_backs_off_and_is_reported(tmp_path):
    child = FakeChild("nats")
    failing = [OSError("Resource temporarily unavailable")] * 2

    def respawn(c):
        if failing:
            raise failing.pop()
        c.pid, c.code = c.pid + 1, None

    events = []
    sup = Supervisor(
        lambda: [child],
        respawn,
        tmp_path / "supervisor.log",
        threading.Lock(),
        backoff=Backoff(0.5, 4.0, 60.0),
        on_event=events.append,
    )
    child.code = 1
    sup.tick(0.0)  # dead: first try due at 0.5
    sup.tick(0.5)  # fails: next at 0.5 + 1.0, not on every 0.2 s poll
    assert child.restart_at == 1.5
    sup.tick(1.0)
    assert [e.event for e in events] == ["exited", "restart_failed"]
    sup.tick(1.5)  # fails again: 2 s more
    assert child.restart_at == 3.5
    sup.tick(3.5)  # spawns
    assert (child.pid, child.restarts, child.restart_at) == (101, 1, None)
    assert [e.event for e in events] == ["exited", "restart_failed", "restart_failed", "restarted"]
    assert "could not be started again (OSError('Resource" in events[1].describe()
    assert _log(tmp_path)[1]["error"] == "OSError('Resource temporarily unavailable')"


def test_no_restart_after_stop(tmp_path):
    child = FakeChild("nats", code=-signal.SIGKILL)
    sup, _ = _supervisor(tmp_path, [child])
    sup.tick(0.0)
    assert child.restart_at is not None
    sup.stop()
    sup.tick(100.0)
    assert child.spawned == []


# ------------------------------------------------------------------ real stack


def _wait(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        with_value = None
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            with_value = cond()
        if with_value:
            return with_value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _gateway_ready(stack: Stack) -> dict:
    return httpx.get(f"{stack.base_url}/readyz", timeout=2).json()


@pytest.mark.slow
def test_stack_restarts_a_killed_replica_nats_and_gateway_at_once(tmp_path, free_port):
    events = []
    stack = Stack(
        state_dir=tmp_path / "state",
        replicas=1,
        port=free_port(),
        tracing=False,
        min_cacheable_tokens=64,
        on_event=events.append,
    )
    stack.start()
    seen_pids: set[int] = set()
    try:
        by_name = {c.name: c for c in stack.children}
        seen_pids |= {c.pid for c in stack.children}
        replica, nats, gateway = by_name["replica-0"], by_name["nats"], by_name["gateway"]
        old, old_nats, old_gw = replica.pid, nats.pid, gateway.pid
        # All three at once (a node's bad minute): each is restarted on its own backoff,
        # and they find each other again. The gateway's ledger is on disk, its port and
        # flags are the same.
        for pid in (old, old_nats, old_gw):
            os.kill(pid, signal.SIGKILL)
        _wait(
            lambda: replica.pid != old and nats.pid != old_nats and gateway.pid != old_gw,
            15,
            "all three to be spawned again",
        )
        seen_pids |= {replica.pid, nats.pid, gateway.pid}
        _wait(lambda: httpx.get(f"{replica.url}/readyz", timeout=2).status_code == 200, 120, "r0")
        port = int(stack.nats_url.rsplit(":", 1)[1])
        _wait(lambda: socket.create_connection(("127.0.0.1", port), 1).close() or True, 15, "nats")
        _wait(
            lambda: (
                (b := _gateway_ready(stack))["event_plane"] == "connected"
                and b["replicas_live"] == 1
            ),
            60,
            "the new gateway to reconnect and see the replica",
        )
        ep = json.loads((stack.state_dir / "endpoint.json").read_text())
        assert ep["pids"]["replica-0"] == replica.pid  # scripts see the new process

        client = anthropic.Anthropic(
            base_url=stack.base_url, api_key=stack.keys["api_key"], max_retries=0, timeout=60
        )
        for _ in range(2):
            msg = client.messages.create(
                model="cachepoint-tiny",
                max_tokens=4,
                messages=[{"role": "user", "content": "after the restarts"}],
            )
            assert msg.usage.output_tokens >= 1

        lines = [
            json.loads(x)
            for x in (stack.state_dir / "logs" / "supervisor.log").read_text().splitlines()
        ]
        for name, pid in (("replica-0", old), ("nats", old_nats), ("gateway", old_gw)):
            died = [ln for ln in lines if ln["child"] == name and ln["event"] == "exited"]
            assert died, lines
            assert died[0]["pid"] == pid
            assert died[0]["signal"] == "SIGKILL"
            assert died[0]["restart"] == 1 and died[0]["backoff_s"] == 0.5
            assert any(ln["child"] == name and ln["event"] == "restarted" for ln in lines)
        assert {(e.child, e.event) for e in events} >= {
            ("replica-0", "exited"),
            ("replica-0", "restarted"),
            ("nats", "exited"),
            ("nats", "restarted"),
        }
    finally:
        stack.stop()
    time.sleep(0.3)
    assert not [p for p in seen_pids if _alive(p)], "orphan processes left"


@pytest.mark.slow
def test_stop_during_a_pending_restart_leaves_nothing(tmp_path, free_port):
    stack = Stack(
        state_dir=tmp_path / "state",
        replicas=1,
        port=free_port(),
        tracing=False,
        backoff=Backoff(3.0, 30.0, 60.0),
    )
    stack.start()
    pids = {c.pid for c in stack.children}
    replica = next(c for c in stack.children if c.name == "replica-0")
    os.kill(replica.pid, signal.SIGKILL)
    _wait(lambda: replica.restart_at is not None, 5, "the death to be seen")
    stack.stop()  # the restart was due in 3 s; it must never happen
    time.sleep(3.5)
    assert replica.restarts == 0
    assert not [p for p in pids if _alive(p)]
    lines = (stack.state_dir / "logs" / "supervisor.log").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["exited"]
