"""Trace-driven cluster simulator on the real kvcore pool and routing policies.

`cachepoint sim` is its command line; docs/sim.md describes the model and formats.
"""

from cachepoint.sim.billing import PriceTable, Usage
from cachepoint.sim.bound import CacheBound, ReuseProfile, infinite_cache_bound, reuse_profile
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.result import SimResult
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator, run_simulation
from cachepoint.sim.trace import (
    Trace,
    TraceBreakpoint,
    TraceError,
    TraceRecorder,
    TraceRequest,
    dump_trace,
    load_trace,
    parse_trace,
    write_trace,
)

__all__ = [
    "CacheBound",
    "PreparedTrace",
    "PriceTable",
    "ReplicaCostModel",
    "ReuseProfile",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Trace",
    "TraceBreakpoint",
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
