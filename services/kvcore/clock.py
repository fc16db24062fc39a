"""Injectable time. Retention is about wall-clock TTLs; tests must not sleep."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def __call__(self) -> float:
        """Seconds, monotonic non-decreasing."""
        ...


def monotonic_clock() -> float:
    return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: for tests and the trace simulator."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start  # current time in seconds

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self.now += seconds
