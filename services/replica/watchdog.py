"""Takes a replica whose scheduler loop died out of service, then out of the process.

On loop death the core itself fails every request it held (``TorchCore._die``);
heartbeats stop and ``/readyz`` fails because both read ``ReplicaCore.alive``. What is
left is here: log it, and ask the server to exit non-zero, so that Kubernetes (or the
embedded stack's supervisor) starts a fresh process with a fresh epoch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from cachepoint.replica.interface import ReplicaCore
from cachepoint.replica.requestlog import LOGGER
from cachepoint.replica.step import StepPlan

log = logging.getLogger(f"{LOGGER}.watchdog")

# NOTE: sysexits.h EX_SOFTWARE, an internal software error: not 0 (a clean stop), not
# 1 or 2 (a crash or a usage error at start), and not a signal.
EXIT_LOOP_DIED = 70

# Test-only: "loop" makes the scheduler loop raise at its first step with work, so a
# real process can be seen to die and exit. Only whoever starts the process can set it.
FAULT_ENV = "CACHEPOINT_REPLICA_FAULT_INJECT"

ExitRequest = Callable[[int], None]


class InjectedFault(RuntimeError):
    """Raised by the fault injection hook."""


def _inject(plan: StepPlan[Any]) -> None:
    raise InjectedFault(f"injected scheduler loop fault ({FAULT_ENV}=loop)")


def arm(scheduler: ReplicaCore, state: Any) -> None:
    """Watch ``scheduler``; on loop death call ``state.request_exit(EXIT_LOOP_DIED)``.

    ``state`` is the app's state; ``cachepoint.runtime.serve`` puts ``request_exit`` there. It
    is read at death time, and without it (an app served by a test) the replica stays
    up, answering 503, with no heartbeats.
    """

    def on_death(exc: BaseException) -> None:
        request_exit: ExitRequest | None = getattr(state, "request_exit", None)
        log.critical(
            "scheduler loop died: %s",
            "exiting" if request_exit else "no exit hook, serving 503 until restarted",
            extra={
                "fields": {
                    "event": "replica_exit" if request_exit else "replica_dead",
                    "replica": scheduler.name,
                    "epoch": scheduler.epoch,
                    "exit_code": EXIT_LOOP_DIED if request_exit else None,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            },
        )
        if request_exit is not None:
            request_exit(EXIT_LOOP_DIED)

    scheduler.on_death = on_death
    inject = os.environ.get(FAULT_ENV)
    if inject == "loop":
        scheduler.fault_hook = _inject
        log.warning("fault injection armed: the scheduler loop dies at its first step")
    elif inject:
        log.warning("%s=%s is not a known fault (known: loop); ignored", FAULT_ENV, inject)
