"""Handing memory back to the OS after a large request.

NOTE: CPython frees a large body's objects to glibc's malloc, which keeps most of the
pages in its arenas: measured here, the gateway's RSS stayed near 2.4 GB after a 25 MB
body was refused. ``malloc_trim(0)`` returns the free pages; it takes tens of ms on a
big heap and locks the arenas meanwhile, so it runs in a worker thread, once a little
after the last large body, never per request.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

LARGE_BYTES = 4 * 2**20  # bodies from this size schedule a trim
DELAY_S = 0.5  # after the last large body, so a burst trims once


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        fn = getattr(libc, "malloc_trim", None)
    except OSError:
        return None
    if fn is None:
        return None  # not glibc (musl, macOS): nothing to do
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn  # type: ignore[no-any-return]


_TRIM = _load_trim()
_pending: list[asyncio.TimerHandle] = []


def trim_now() -> bool:
    """Return free heap pages to the OS; False where there is no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def trim_after(nbytes: int) -> None:
    """Note a body of ``nbytes`` just handled (on the event loop): from LARGE_BYTES, a
    trim runs in the default executor DELAY_S later (a later large body moves it)."""
    if nbytes < LARGE_BYTES or _TRIM is None:
        return
    loop = asyncio.get_running_loop()
    for handle in _pending:
        handle.cancel()
    _pending.clear()

    def fire() -> None:
        _pending.clear()
        loop.run_in_executor(None, trim_now)

    _pending.append(loop.call_later(DELAY_S, fire))
