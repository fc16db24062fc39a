"""`cachepoint sim`: replay a trace on a simulated fleet, write the report, measure scaling."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from cachepoint.kvcore import DEFAULT_EVICTION, EVICTION_POLICIES
from cachepoint.routing import DEFAULT_POLICY, POLICIES
from cachepoint.sim.progress import ProgressBar
from cachepoint.sim.report import write_report
from cachepoint.sim.scaling import run_scaling
from cachepoint.sim.simulator import RETENTION_MODES, PreparedTrace, SimConfig, Simulator
from cachepoint.sim.trace import TraceError, load_trace

# NOTE: read from the product's own defaults, so "what the product ships" stays true
# when either changes; docs/sim.md has the measurements behind both.
SHIPPED_POLICY = DEFAULT_POLICY  # the gateway's routing
SHIPPED_EVICTION = DEFAULT_EVICTION  # the replica's pool eviction
TRACE_ENV = "CACHEPOINT_TRACE"  # overrides where the default trace is looked for
# Where a full Mooncake trace is looked for (from the cwd) before the bundled sample.
DEFAULT_TRACES = ("traces/conversation_trace.jsonl",)
# NOTE: a path next to this module (package data, see pyproject.toml), so an installed
# `cachepoint sim` finds it from any cwd: the first 500 requests (165 s) of Mooncake's
# conversation trace, 124 KB. Its infinite-cache bound is 16 %, the full trace's 37 %.
SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "conversation_sample.jsonl"


def full_trace() -> str | None:
    """$CACHEPOINT_TRACE, else the first of DEFAULT_TRACES that exists, else None."""
    env = os.environ.get(TRACE_ENV)
    if env:
        return env
    return next((p for p in DEFAULT_TRACES if Path(p).is_file()), None)


def default_trace() -> str:
    """The trace a run without ``--trace`` replays: `full_trace`, else the bundled sample."""
    return full_trace() or str(SAMPLE_TRACE)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _share(text: str, *, zero_ok: bool) -> float:
    """A share written 0.01 or 1%; within (0, 1], or [0, 1] with ``zero_ok``."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.01 or 1%, got {text!r}"
        ) from None
    if not (0 <= value <= 1 if zero_ok else 0 < value <= 1):
        bounds = "[0, 1]" if zero_ok else "(0, 1]"
        raise argparse.ArgumentTypeError(f"must be within {bounds}, got {text}")
    return value


def _fraction(text: str) -> float:
    """A share: 0.01 or 1%."""
    return _share(text, zero_ok=False)


def _tier_fraction(text: str) -> float:
    """A tier's share: like `_fraction`, but 0 (no such tier) is allowed."""
    return _share(text, zero_ok=True)


def _add_trace_arg(p: argparse.ArgumentParser, *, sample: bool = True) -> None:
    fallback = ", else the bundled sample (500 requests of Mooncake's conversation trace)"
    p.add_argument(
        "--trace",
        metavar="FILE",
        help=(
            "trace JSONL (Mooncake or Cachepoint format; docs/sim.md). Default: "
            f"${TRACE_ENV}, else {' or '.join(DEFAULT_TRACES)}{fallback if sample else ''}"
        ),
    )


def add_sim_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register `sim` (and its `report` and `scaling` subcommands) on the main parser."""
    sim: argparse.ArgumentParser = sub.add_parser(
        "sim",
        help="replay a request trace on a simulated fleet of kvcore replicas",
        description=(
            "Replays a request trace on N simulated replicas, each a real kvcore pool, "
            "routed by the real routing policies over the real kv event path. Prints the "
            "hit ratio against the infinite-cache bound, TTFT, queueing, load balance and "
            "the bill. `cachepoint sim report` writes the plots and summary to bench/sim/."
        ),
    )
    _add_trace_arg(sim)
    sim.add_argument("--replicas", type=_positive_int, default=16, help="replicas (16)")
    sim.add_argument(
        "--capacity-frac",
        type=_fraction,
        default=0.01,
        metavar="F",
        help="pool size per replica as a share of the trace's distinct blocks (0.01 = 1%%)",
    )
    sim.add_argument(
        "--capacity-blocks",
        type=_positive_int,
        metavar="N",
        help="pool size per replica in kvcore blocks (overrides --capacity-frac)",
    )
    sim.add_argument(
        "--host-frac",
        type=_tier_fraction,
        default=0.0,
        metavar="F",
        help=(
            "host-memory tier per replica, a share of the trace's distinct blocks like "
            "--capacity-frac (0 = none, the default); blocks evicted from the device go "
            "there and come back over PCIe (docs/sim.md)"
        ),
    )
    sim.add_argument(
        "--disk-frac",
        type=_tier_fraction,
        default=0.0,
        metavar="F",
        help="local-disk tier per replica behind the host tier, likewise (0 = none)",
    )
    sim.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=SHIPPED_POLICY,
        help=(
            f"routing policy ({SHIPPED_POLICY}: the gateway's default, what the product "
            "ships; prefix_affinity measured best on the conversation trace, docs/sim.md)"
        ),
    )
    sim.add_argument(
        "--eviction",
        choices=[*sorted(EVICTION_POLICIES), "oracle"],
        default=SHIPPED_EVICTION,
        help=(
            f"pool eviction ({SHIPPED_EVICTION}: the replica's default, what the product "
            "ships; oracle is clairvoyant, a reference only)"
        ),
    )
    sim.add_argument(
        "--retention",
        choices=RETENTION_MODES,
        default="none",
        help=(
            "none: no cache_control markers; 5m/1h: every request marks its whole prompt; "
            "trace: the trace's own breakpoints (none)"
        ),
    )
    sim.add_argument(
        "--retained-share", type=_fraction, default=0.5, metavar="F", help="retention cap (0.5)"
    )
    sim.add_argument(
        "--block-size",
        type=_positive_int,
        help="kvcore block size in tokens; must divide the trace's (default: the trace's)",
    )
    sim.add_argument(
        "--time-scale",
        type=_positive_float,
        default=1.0,
        metavar="X",
        help="multiply arrival times by X (0.5 = twice the request rate) (1.0)",
    )
    sim.add_argument(
        "--event-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds before kv events reach the router (0)",
    )
    sim.add_argument(
        "--max-waiting", type=_positive_int, metavar="N", help="per-replica queue bound (none)"
    )
    sim.add_argument("--seed", type=int, default=0, help="seed of every random choice (0)")
    sim.add_argument(
        "--limit", type=_positive_int, metavar="N", help="replay only the first N requests"
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument(
        "--full", action="store_true", help="with --json: add every TTFT and per-replica stats"
    )
    prog = sim.add_mutually_exclusive_group()
    prog.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="force the bar"
    )
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="no bar")

    sub2 = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    report = sub2.add_parser(
        "report",
        help="run the sweep and write bench/sim/ (PNG plots + summary.md)",
        description=(
            "Runs every configuration the report needs (replicas 1/4/16/64 x capacities "
            "x policies, TTFT, load balance, retention TTLs) and writes PNG plots and a "
            "markdown summary."
        ),
    )
    _add_trace_arg(report, sample=False)
    report.add_argument("--out", default="bench/sim", help="output folder (bench/sim)")
    report.add_argument(
        "--jobs", type=_positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    report.add_argument(
        "--quick", action="store_true", help="first 2,000 requests and fewer points (smoke run)"
    )
    scaling = sub2.add_parser(
        "scaling",
        help="measure router memory, CPU and event traffic on the real index and event code",
        description=(
            "Measures PrefixIndex memory and match cost per million indexed blocks, the "
            "events per second one router applies, and the msgpack bytes of event batches "
            "from a replay; prints the table docs/scaling.md is built from."
        ),
    )
    _add_trace_arg(scaling)
    scaling.add_argument(
        "--blocks", type=_positive_int, default=1_000_000, help="indexed blocks (1,000,000)"
    )
    scaling.add_argument(
        "--block-size",
        type=_positive_int,
        help="kvcore block size of the replay (default: the trace's)",
    )
    scaling.add_argument(
        "--capacity-frac",
        type=_fraction,
        default=0.01,
        metavar="F",
        help="pool size per replica in the replay, share of distinct blocks (0.01)",
    )
    scaling.add_argument("--json", action="store_true", help="print one JSON object")
    return sim


def _resolve_trace(given: str | None) -> str:
    return given or default_trace()


def _resolve_full_trace(parser: argparse.ArgumentParser, given: str | None) -> str:
    """The report's trace: never the sample unless named, since the report it writes
    (bench/sim/ by default) is the one built from a full trace."""
    path = given or full_trace()
    if path is None:
        parser.error(
            f"no trace given and none at ${TRACE_ENV} or {' or '.join(DEFAULT_TRACES)}; "
            "the report needs a full trace: pass --trace FILE (Mooncake's "
            "conversation_trace.jsonl, docs/sim.md)"
        )
    return path


def run_sim_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Dispatch `cachepoint sim ...`; trace and option errors print one line, exit 2."""
    try:
        if args.sim_command == "report":
            return write_report(
                _resolve_full_trace(parser, args.trace),
                Path(args.out),
                jobs=args.jobs,
                quick=args.quick,
            )
        if args.sim_command == "scaling":
            return run_scaling(
                _resolve_trace(args.trace),
                args.blocks,
                block_size=args.block_size,
                capacity_frac=args.capacity_frac,
                as_json=args.json,
            )
        return _run_one(args, parser)
    except (TraceError, ValueError) as exc:
        print(f"cachepoint sim: error: {exc}", file=sys.stderr)
        return 2


def _run_one(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    trace = load_trace(_resolve_trace(args.trace))
    if args.limit:
        trace = trace.head(args.limit)
    config = SimConfig(
        replicas=args.replicas,
        capacity_frac=args.capacity_frac,
        capacity_blocks=args.capacity_blocks,
        host_frac=args.host_frac,
        disk_frac=args.disk_frac,
        block_size=args.block_size,
        policy=args.policy,
        eviction=args.eviction,
        retention=args.retention,
        retained_share=args.retained_share,
        time_scale=args.time_scale,
        event_delay_s=args.event_delay,
        max_waiting=args.max_waiting,
        seed=args.seed,
    )
    prepared = PreparedTrace.build(trace, args.block_size)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = None
    if show:
        progress = ProgressBar()
    result = Simulator(prepared, config).run(progress)
    if args.json:
        print(json.dumps(result.to_json(full=args.full)))
    else:
        print(format_summary(result.to_json()))
    return 0


def format_summary(r: dict[str, Any]) -> str:
    """The human-readable block `cachepoint sim` prints without --json."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f} s"

    lines = [
        f"trace        {r['trace']}  ({r['requests']:,} requests)",
        f"fleet        {r['replicas']} replicas x {r['capacity_blocks']:,} blocks of "
        f"{r['block_size']} tokens ({pct(r['capacity_frac'])} of distinct blocks each)",
        f"policy       {r['policy']} routing, {r['eviction']} eviction, retention {r['retention']}",
        *_tier_lines(r),
        f"hit ratio    {pct(r['hit_ratio'])} of prefix blocks "
        f"(tokens {pct(r['token_hit_ratio'])}); bound {pct(r['bound'])}; "
        f"ratio to bound {pct(r['ratio_to_bound'])}",
        f"TTFT         p50 {sec(r['ttft_p50_s'])}  p90 {sec(r['ttft_p90_s'])}  "
        f"p99 {sec(r['ttft_p99_s'])}",
        f"queueing     p50 {sec(r['queue_p50_s'])}  p90 {sec(r['queue_p90_s'])}  "
        f"p99 {sec(r['queue_p99_s'])}  mean {sec(r['queue_mean_s'])}",
        f"load         imbalance (max/mean busy) {r['load_imbalance']:.2f}, "
        f"cv {r['load_cv']:.2f}; rejected {r['rejected']}",
        f"bill         ${r['billed_cost']:,.2f} vs ${r['uncached_cost']:,.2f} uncached "
        f"(saving {pct(r['cost_saving'])})",
        f"events       {r['events']:,} kv events applied, {r['event_blocks']:,} block hashes",
        f"elapsed      {r['elapsed_s']:.1f} s replay + {r['prepare_s']:.1f} s load/hash",
    ]
    return "\n".join(lines)


def _tier_lines(r: dict[str, Any]) -> list[str]:
    """The lower tiers' lines of the summary; none for a device-only fleet."""
    if not r.get("tiers"):
        return []
    by_tier = r["hit_ratio_by_tier"]
    lines = []
    for name, t in r["tiers"].items():
        frac = r.get(f"{name}_frac", 0.0)
        lines.append(
            f"{name + ' tier':<13}{t['slots']:,} blocks per replica ({100 * frac:.1f}% of "
            f"distinct); {100 * by_tier.get(name, 0.0):.1f}% of prefix blocks hit here; "
            f"{t['promotions']:,} promoted, {t['demotions']:,} demoted, "
            f"{t['dropped']:,} dropped"
        )
    wait = r.get("promote_p90_s")
    if wait is not None:
        lines.append(
            f"promotions   {r['promoted_requests']:,} requests waited p50 "
            f"{1000 * r['promote_p50_s']:.1f} ms, p90 {1000 * wait:.1f} ms for their copies"
        )
    return lines
