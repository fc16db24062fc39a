"""Keep the embedded stack's children running: restart what dies, with backoff.

A thread polls the children. One that exited is reported (the console callback and a
JSON line in ``logs/supervisor.log``) and started again from the very arguments and
environment it was first spawned with, after a delay that doubles on each restart in
a row (0.5 s, 1 s, 2 s … 30 s) and resets once the child has stayed up a minute.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from cachepoint.embedded.private import open_log


@dataclass(frozen=True, slots=True)
class Backoff:
    initial_s: float = 0.5  # delay before the first restart in a row
    max_s: float = 30.0  # the delay never grows past this
    reset_after_s: float = 60.0  # a child up this long starts again from initial_s

    def delay(self, in_a_row: int) -> float:
        """Delay before restart number ``in_a_row`` (1 = the first in a row)."""
        return min(self.max_s, self.initial_s * 2 ** max(0, in_a_row - 1))


@dataclass(frozen=True, slots=True)
class ChildEvent:
    """One line of the supervisor's log."""

    at: float  # wall-clock time (epoch seconds)
    child: str  # nats, replica-0, gateway
    event: str  # "exited" (a restart is scheduled), "restarted", or "restart_failed"
    pid: int  # the process that exited, or the new one
    exit_code: int | None  # its exit status when it exited on its own
    signal: str | None  # the signal that ended it (SIGKILL, …), if one did
    restart: int  # which restart of this child this is, ever (1 = the first)
    backoff_s: float  # delay before this restart
    error: str | None = None  # why a restart could not spawn the process

    def describe(self) -> str:
        if self.event == "exited":
            how = self.signal or f"code {self.exit_code}"
            return (
                f"{self.child} (pid {self.pid}) died ({how}); "
                f"restart #{self.restart} in {self.backoff_s:.1f}s"
            )
        if self.event == "restart_failed":
            return (
                f"{self.child} could not be started again ({self.error}); "
                f"next try in {self.backoff_s:.1f}s"
            )
        return f"{self.child} restarted (restart #{self.restart}, pid {self.pid})"


class Supervised(Protocol):
    """What the supervisor needs of a child (stack.Child)."""

    name: str
    started_at: float
    restarts: int
    in_a_row: int
    restart_at: float | None

    @property
    def pid(self) -> int: ...

    def returncode(self) -> int | None: ...


def exit_fields(returncode: int) -> tuple[int | None, str | None]:
    """Popen's returncode (negative = killed by that signal) as (code, signal name)."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"signal {-returncode}"
    return returncode, None


class Supervisor:
    """Polls ``children()`` every ``poll_s`` and restarts the dead through ``respawn``.

    ``respawn(child)`` must replace the child's process (under ``lock``); ``stop()``
    joins the thread, after which nothing is spawned again.
    """

    def __init__(
        self,
        children: Callable[[], list[Supervised]],
        respawn: Callable[[Supervised], None],
        log_path: Path,
        lock: threading.Lock,
        *,
        backoff: Backoff | None = None,
        on_event: Callable[[ChildEvent], None] = lambda _: None,
        poll_s: float = 0.2,
    ) -> None:
        self.children = children
        self.respawn = respawn
        self.log_path = log_path
        self.lock = lock
        self.backoff = backoff or Backoff()
        self.on_event = on_event
        self.poll_s = poll_s
        self.stopping = False  # set under lock by stop(); no spawn happens after it
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachepoint-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """No restart from now on (a spawn in progress finishes first)."""
        with self.lock:
            self.stopping = True

    def join(self) -> None:
        """End the thread; call it after the children are stopped.

        NOTE: Linux delivers PR_SET_PDEATHSIG when the *thread* that forked a child
        exits, so the restarted children would get SIGTERM the moment this thread
        ends: it must outlive them, or the stack's ordered shutdown is lost."""
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(30)

    def stop(self) -> None:
        self.halt()
        self.join()

    def _run(self) -> None:
        while not self._wake.wait(self.poll_s):
            try:
                self.tick(time.monotonic())
            except Exception as exc:  # NOTE: the supervisor itself must never die
                self._log({"at": time.time(), "event": "supervisor_error", "error": repr(exc)})

    def tick(self, now: float) -> None:
        for child in list(self.children()):
            # NOTE: under the lock: stop() halts before it kills, so a child that
            # stop() ended is never seen here as a death to report.
            with self.lock:
                if self.stopping:
                    return
                code = child.returncode()
            if code is None:
                if child.in_a_row and now - child.started_at >= self.backoff.reset_after_s:
                    child.in_a_row = 0
                continue
            if child.restart_at is None:
                child.in_a_row += 1
                delay = self.backoff.delay(child.in_a_row)
                child.restart_at = now + delay
                exit_code, sig = exit_fields(code)
                self._emit(
                    ChildEvent(
                        time.time(),
                        child.name,
                        "exited",
                        child.pid,
                        exit_code,
                        sig,
                        child.restarts + 1,
                        delay,
                    )
                )
            elif now >= child.restart_at:
                with self.lock:
                    if self.stopping:
                        return
                    try:
                        self.respawn(child)
                    except Exception as exc:  # fork limit, binary gone: back off, retry
                        child.in_a_row += 1
                        delay = self.backoff.delay(child.in_a_row)
                        child.restart_at = now + delay
                        event = ChildEvent(
                            time.time(),
                            child.name,
                            "restart_failed",
                            child.pid,
                            None,
                            None,
                            child.restarts + 1,
                            delay,
                            repr(exc),
                        )
                    else:
                        child.restarts += 1
                        child.restart_at = None
                        child.started_at = time.monotonic()
                        event = ChildEvent(
                            time.time(),
                            child.name,
                            "restarted",
                            child.pid,
                            None,
                            None,
                            child.restarts,
                            self.backoff.delay(child.in_a_row),
                        )
                self._emit(event)

    def _emit(self, ev: ChildEvent) -> None:
        self._log(asdict(ev))
        try:
            self.on_event(ev)
        except Exception as exc:  # a console that fails must not stop restarts
            self._log({"at": time.time(), "event": "report_error", "error": repr(exc)})

    def _log(self, line: dict[str, object]) -> None:
        with open_log(self.log_path, append=True) as fh:  # 0600, like the stack's files
            fh.write((json.dumps(line) + "\n").encode())
