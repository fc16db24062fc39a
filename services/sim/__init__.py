"""Trace-driven cluster simulator on the real kvcore pool and routing policies.

`cachepoint sim` is its command line; docs/sim.md describes the model and formats.
"""

from .billing import PriceTable, Usage
from .bound import CacheBound, ReuseProfile, infinite_cache_bound, reuse_profile
from .cost import ReplicaCostModel
from .result import SimResult
from .simulator import PreparedTrace, SimConfig, Simulator, run_simulation
from .trace import (
    Breakpoint,
    Trace,
    TraceError,
    TraceRecorder,
    TraceRequest,
    dump_trace,
    load_trace,
    parse_trace,
    write_trace,
)

__all__ = [
    "Breakpoint",
    "CacheBound",
    "PreparedTrace",
    "PriceTable",
    "ReplicaCostModel",
    "ReuseProfile",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Trace",
    "TraceError",
    "TraceRecorder",
    "TraceRequest",
    "Usage",
    "dump_trace",
    "infinite_cache_bound",
    "load_trace",
    "parse_trace",
    "reuse_profile",
    "run_simulation",
    "write_trace",
]
