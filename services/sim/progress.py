"""A one-line progress bar on stderr, for long replays."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Redraws ``[#####.....]  45%  5,400/12,031 requests  1.2 s`` in place.

    NOTE: it writes only to stderr, so `--json` output on stdout stays one clean
    object, and it redraws at most ten times a second so a fast replay is not
    slowed by its own terminal writes.
    """

    __slots__ = ("_last", "_start", "label", "stream", "width")

    def __init__(self, label: str = "requests", stream: TextIO | None = None, width: int = 30):
        self.label = label  # unit printed after the counts
        self.stream = stream or sys.stderr  # where the bar goes
        self.width = width  # characters between the brackets
        self._start = time.perf_counter()  # when the bar was created
        self._last = 0.0  # when it was last drawn

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r[{bar}] {frac:4.0%}  {done:,}/{total:,} {self.label}  {now - self._start:.1f} s"
        )
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
