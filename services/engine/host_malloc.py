"""glibc's malloc, kept from handing a step's activations back to the kernel.

A CPU forward allocates its activations fresh at every op: a 2k-token prefill of
SmolLM2 makes [tokens, 3,072] float32 buffers of 20-odd MiB, dozens per layer. glibc
serves blocks that large with ``mmap`` and returns them with ``munmap`` when freed
(its threshold adapts, but only up to 32 MiB and only after a free), so the next op
takes a page fault on every 4 KiB of its output before it computes anything. Measured
on a cold 1,800-token prefill through the replica: 2.62-2.75 s with the thresholds
below against 2.88-2.97 s without (bench/RESULTS.md, "the cold prefill caught up",
part 2). vLLM preloads tcmalloc into its CPU workers for the same reason; this keeps
glibc and sets two of its knobs instead of adding an allocator.

The cost: up to ``TRIM_THRESHOLD`` of freed heap stays mapped between steps, which a
replica uses again at its next step anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

ENV_SWITCH = "CACHEPOINT_MALLOC_TUNING"  # "0" leaves glibc's defaults

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# NOTE: glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX);
# mallopt refuses more. Blocks this size and below come from the heap and stay there.
MMAP_THRESHOLD = 32 << 20
# Free heap kept mapped before glibc trims it back to the kernel.
TRIM_THRESHOLD = 512 << 20
# What a caller may already have set for glibc, which is then left as it is.
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_tuned: bool | None = None  # the outcome of the first call, once per process


def tune() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); returns whether
    they are set. Nothing is done off glibc, with ``CACHEPOINT_MALLOC_TUNING=0``, or
    when the environment already sets glibc's own ``MALLOC_*_THRESHOLD_``."""
    global _tuned
    if _tuned is None:
        _tuned = _tune()
    return _tuned


def _tune() -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if any(name in os.environ for name in _GLIBC_ENV):
        return False  # the operator's choice stands
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.warning("mallopt refused the engine's thresholds; glibc's defaults stay")
    return ok
