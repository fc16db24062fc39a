"""`cachepoint sim report`: the sweep behind bench/sim/, its PNG plots and its summary.

Every number in the summary comes from a run made by this module in the same
invocation; nothing is carried over from elsewhere.
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: what ships is read from the product's defaults, as cli.py's SHIPPED_* are, and
# not from cli.py: the CLI imports this module, so that was a cycle.
from cachepoint.kvcore import DEFAULT_EVICTION as SHIPPED_EVICTION
from cachepoint.routing import DEFAULT_POLICY as SHIPPED_POLICY
from cachepoint.routing import CacheAwarePolicy
from cachepoint.sim.billing import PriceTable
from cachepoint.sim.bound import reuse_profile
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.progress import ProgressBar
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator
from cachepoint.sim.trace import load_trace

BASELINE = "cache_aware + lru"  # the simplest baseline: longest match, load penalty, LRU
SHIPPED = f"{SHIPPED_POLICY} + {SHIPPED_EVICTION}"  # the label of what the product ships
TARGETS = {0.01: 0.95, 0.005: 0.80}  # capacity per replica -> ratio-to-bound goal
ORACLE = "prefix_affinity + oracle"  # the clairvoyant reference
# NOTE: a label is "routing + eviction"; the routing may carry options as
# "name:key=value,...". This one is the default docs/sim.md recommends.
LIGHT_LOAD = "cache_aware:load_weight=0.1"  # cache_aware with a fifth of the shipped load weight
# NOTE: drawn only while the shipped cache_aware weighs load differently; once it is
# the default, "cache_aware + ..." is the same configuration.
_LIGHT = (LIGHT_LOAD,) if CacheAwarePolicy().load_weight != 0.1 else ()


@dataclass(frozen=True, slots=True)
class Line:
    """One routing + eviction combination drawn as a line."""

    label: str  # legend text
    policy: str  # routing policy name
    eviction: str  # eviction strategy name
    reference: bool = False  # clairvoyant: drawn dashed, never a product setting


_LINES = (
    Line("round_robin + lru", "round_robin", "lru"),
    Line("least_loaded + lru", "least_loaded", "lru"),
    Line(BASELINE, "cache_aware", "lru"),
    Line("cache_aware + reuse_credit", "cache_aware", "reuse_credit"),
    Line("prefix_affinity + lru", "prefix_affinity", "lru"),
    Line("prefix_affinity + reuse_credit", "prefix_affinity", "reuse_credit"),
    Line("prefix_affinity + hit_density", "prefix_affinity", "hit_density"),
    *(Line(f"{p} + reuse_credit", p, "reuse_credit") for p in _LIGHT),
)
LINES = (
    *_LINES,
    *(
        []
        if SHIPPED in {x.label for x in _LINES}
        else [Line(SHIPPED, SHIPPED_POLICY, SHIPPED_EVICTION)]
    ),
    Line(ORACLE, "prefix_affinity", "oracle", reference=True),  # last: LINES[:-1] skips it
)
# Lines of the host-size curve.
CURVE = tuple(
    dict.fromkeys(
        (
            "round_robin + lru",
            BASELINE,
            SHIPPED,
            *(f"{p} + reuse_credit" for p in _LIGHT),
            "prefix_affinity + reuse_credit",
        )
    )
)
# Lines of the one-pool reference, where routing cannot lose a hit.
POOLED = tuple(dict.fromkeys((BASELINE, SHIPPED, "prefix_affinity + hit_density", ORACLE)))


@dataclass(frozen=True, slots=True)
class Sweep:
    """The grid one report runs."""

    limit: int | None  # requests replayed (None: all)
    replicas: tuple[int, ...]  # fleet sizes of the capacity plot
    fracs: tuple[float, ...]  # capacities per replica of the capacity plot
    time_scales: tuple[float, ...]  # offered-load points (arrival time multipliers)
    retentions: tuple[str, ...] = ("none", "5m", "1h")  # cost-vs-TTL points
    headline_replicas: int = 16  # the fleet of the headline table
    headline_fracs: tuple[float, ...] = (0.01, 0.005)  # the capacities of the headline table
    seeds: tuple[int, ...] = (0, 1, 2)  # seeds of the headline runs (the rest use seed 0)
    # KV tiers, all at the headline fleet size and seed 0:
    # (device, host) capacities per replica with a goal, each run for every grid combination
    tier_points: tuple[tuple[float, float], ...] = ((0.01, 0.04), (0.005, 0.02))
    grid_policies: tuple[str, ...] = (
        "round_robin",
        "least_loaded",
        "cache_aware",
        *_LIGHT,
        "prefix_affinity",
    )
    grid_evictions: tuple[str, ...] = ("lru", "slru", "reuse_credit", "hit_density")
    host_fracs: tuple[float, ...] = (0.01, 0.02, 0.04, 0.08)  # the host-size curve's points
    curve_lines: tuple[str, ...] = CURVE  # its lines
    # (device, host, disk) points of the shipped combination with a disk tier
    disk_points: tuple[tuple[float, float, float], ...] = ((0.01, 0.01, 0.04), (0.005, 0.005, 0.02))


FULL = Sweep(None, (1, 4, 16, 64), (0.0025, 0.005, 0.01, 0.02, 0.04), (1.0, 0.5, 0.25, 0.15))
QUICK = Sweep(
    1500,
    (4, 16),
    (0.005, 0.01),
    (1.0, 0.5),
    grid_policies=("cache_aware", "prefix_affinity"),
    grid_evictions=("lru", "reuse_credit"),
    host_fracs=(0.01, 0.04),
    disk_points=((0.01, 0.01, 0.04),),
)
TIER_GOALS = {(0.01, 0.04): 0.95, (0.005, 0.02): 0.90}  # (device, host) -> ratio-to-bound goal


@dataclass(frozen=True, slots=True)
class Run:
    """One simulation to make: a line under one configuration."""

    line: str  # the Line's label
    replicas: int  # fleet size
    frac: float  # capacity per replica
    retention: str = "none"  # retention mode
    time_scale: float = 1.0  # arrival time multiplier
    keep_ttft: bool = False  # return every TTFT (for the CDF)
    seed: int = 0  # seeds routing ties
    host_frac: float = 0.0  # host tier per replica (0: none)
    disk_frac: float = 0.0  # disk tier per replica (0: none)


_PREPARED: PreparedTrace | None = None  # set before the workers fork


def parse_label(label: str) -> tuple[str, dict[str, float], str]:
    """``"routing[:key=value,...] + eviction"`` -> (routing, its options, eviction)."""
    head, sep, eviction = label.partition(" + ")
    if not sep or not head or not eviction:
        raise ValueError(f"{label!r} is not 'routing + eviction'")
    policy, _, opts = head.partition(":")
    options: dict[str, float] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        try:
            options[key] = float(value)
        except ValueError:
            raise ValueError(f"{label!r}: option {item!r} is not key=number") from None
        if not eq:
            raise ValueError(f"{label!r}: option {item!r} is not key=number")
    return policy, options, eviction


def _config(run: Run) -> SimConfig:
    # NOTE: every label is "routing + eviction", the LINES' and the tier grid's alike.
    policy, options, eviction = parse_label(run.line)
    return SimConfig(
        replicas=run.replicas,
        capacity_frac=run.frac,
        host_frac=run.host_frac,
        disk_frac=run.disk_frac,
        policy=policy,
        policy_options=options,
        eviction=eviction,
        retention=run.retention,
        time_scale=run.time_scale,
        seed=run.seed,
    )


def grid_labels(sweep: Sweep) -> list[str]:
    """Every routing + eviction of the tier grid."""
    return [f"{p} + {e}" for p in sweep.grid_policies for e in sweep.grid_evictions]


def _execute(run: Run) -> dict[str, Any]:
    assert _PREPARED is not None
    result = Simulator(_PREPARED, _config(run)).run()
    out = result.to_json()
    out["line"] = run.line
    out["frac"] = run.frac  # the capacity asked for (capacity_frac is after rounding to blocks)
    out["seed"] = run.seed
    out["host"] = run.host_frac  # the tier sizes asked for
    out["disk"] = run.disk_frac
    if run.keep_ttft:
        out["ttft_s"] = list(result.ttft_s)
    return out


def _plan(sweep: Sweep) -> list[Run]:
    runs: list[Run] = []
    hr = sweep.headline_replicas
    for n in sweep.replicas:
        for frac in sweep.fracs:
            for line in LINES:
                keep = n == hr and frac == sweep.headline_fracs[0]
                runs.append(Run(line.label, n, frac, keep_ttft=keep))
    for frac in sweep.headline_fracs:
        if hr not in sweep.replicas or frac not in sweep.fracs:
            runs.extend(Run(line.label, hr, frac) for line in LINES)
        for seed in sweep.seeds:
            if seed != 0:
                runs.extend(Run(line.label, hr, frac, seed=seed) for line in LINES)
    frac = sweep.headline_fracs[0]
    for ts in sweep.time_scales:
        if ts != 1.0:
            runs.extend(Run(line.label, hr, frac, time_scale=ts) for line in LINES[:-1])
    for ret in sweep.retentions:
        if ret != "none":
            runs.extend(Run(line.label, hr, frac, retention=ret) for line in LINES[:-1])
    # One pool holding the whole fleet's capacity: routing cannot lose anything there.
    # NOTE: its arrivals are stretched by the fleet size, so its one prefill engine
    # is as busy as each of the fleet's; unstretched, queueing would reorder the trace.
    for f in sweep.headline_fracs:
        runs.extend(Run(label, 1, f * hr, time_scale=float(hr)) for label in POOLED)
    # KV tiers: every routing x eviction at each goal point, with and without the host
    # tier; the host-size curve of the drawn lines; the shipped lines with a disk tier.
    for dev, host in sweep.tier_points:
        for label in grid_labels(sweep):
            runs.append(Run(label, hr, dev))
            runs.append(Run(label, hr, dev, host_frac=host))
    for dev in sweep.headline_fracs:
        for host in sweep.host_fracs:
            runs.extend(Run(label, hr, dev, host_frac=host) for label in sweep.curve_lines)
    for dev, host, disk in sweep.disk_points:
        runs.append(Run(SHIPPED, hr, dev, host_frac=host))
        runs.append(Run(SHIPPED, hr, dev, host_frac=host, disk_frac=disk))
    # NOTE: the grid repeats some drawn lines' runs; each configuration runs once.
    return list(dict.fromkeys(runs))


def write_report(
    trace_path: str,
    out: Path,
    *,
    jobs: int = 2,
    quick: bool = False,
    sweep: Sweep | None = None,
) -> int:
    """Run the sweep (``FULL``, ``QUICK``, or one given), write plots, summary.md, results.json."""
    global _PREPARED
    if sweep is None:
        sweep = QUICK if quick else FULL
    trace = load_trace(trace_path)
    if sweep.limit:
        trace = trace.head(sweep.limit)
    out.mkdir(parents=True, exist_ok=True)

    # NOTE: the timing run goes first and alone, so the figure it records is not
    # inflated by the sweep's workers competing for the same two cores.
    t0 = time.perf_counter()
    prepared = PreparedTrace.build(trace)
    shipped = next(x for x in LINES if x.label == SHIPPED)
    timing = Simulator(
        prepared,
        SimConfig(
            replicas=sweep.headline_replicas,
            capacity_frac=sweep.headline_fracs[0],
            policy=shipped.policy,
            eviction=shipped.eviction,
        ),
    ).run()
    timing_total = time.perf_counter() - t0
    tier_timing = None
    if sweep.tier_points:
        dev, host = sweep.tier_points[0]
        tier_timing = Simulator(
            prepared,
            SimConfig(
                replicas=sweep.headline_replicas,
                capacity_frac=dev,
                host_frac=host,
                policy=shipped.policy,
                eviction=shipped.eviction,
            ),
        ).run()
    _PREPARED = prepared

    runs = _plan(sweep)
    bar = ProgressBar("runs")
    results: list[dict[str, Any]] = []
    if jobs > 1 and sys.platform != "win32":
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for i, res in enumerate(pool.map(_execute, runs, chunksize=1)):
                results.append(res)
                bar(i + 1, len(runs))
    else:
        for i, run in enumerate(runs):
            results.append(_execute(run))
            bar(i + 1, len(runs))

    profile = reuse_profile(prepared.trace, prepared.requests)
    meta = {
        "profile": {
            "distinct_blocks": profile.distinct_blocks,
            "used_once": profile.used_once,
            "reuse_given_uses": list(profile.reuse_given_uses),
            "max_live_blocks": profile.max_live_blocks,
            "gap_quantiles_s": [list(q) for q in profile.gap_quantiles_s],
        },
        "trace": trace_path,
        "requests": len(trace),
        "bound": prepared.bound.block_bound,
        "distinct_blocks": prepared.bound.distinct_blocks,
        "timing": {
            "replicas": sweep.headline_replicas,
            "capacity_frac": sweep.headline_fracs[0],
            "replay_s": timing.elapsed_s,
            "prepare_s": timing.prepare_s,
            "total_s": timing_total,
            "ratio_to_bound": timing.ratio_to_bound,
        },
        "tier_timing": None
        if tier_timing is None
        else {
            "capacity_frac": sweep.tier_points[0][0],
            "host_frac": sweep.tier_points[0][1],
            "replay_s": tier_timing.elapsed_s,
            "ratio_to_bound": tier_timing.ratio_to_bound,
        },
        "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "sweep": "full" if sweep == FULL else "quick" if sweep == QUICK else "custom",
    }
    slim = [{k: v for k, v in r.items() if k != "ttft_s"} for r in results]
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": slim}) + "\n")
    _plots(results, sweep, meta, out)
    (out / "summary.md").write_text(_summary(results, sweep, meta))
    print(f"wrote {out}/summary.md, results.json and {len(PLOTS)} plots")
    return 0


# --------------------------------------------------------------------- plots

PLOTS = (
    "hit_ratio_vs_capacity.png",
    "ttft_cdf.png",
    "load_imbalance.png",
    "cost_vs_retention.png",
    "offered_load.png",
    "hit_ratio_vs_host.png",
)


def _pick(results: Sequence[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in results if all(r.get(k) == v for k, v in match.items())]


def _line_of(r: dict[str, Any]) -> str:
    return str(r["line"])


def _plots(results: list[dict[str, Any]], sweep: Sweep, meta: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {"retention": "none", "time_scale": 1.0, "seed": 0, "host": 0.0, "disk": 0.0}
    hr, frac = sweep.headline_replicas, sweep.headline_fracs[0]
    styles = {line.label: ("--" if line.reference else "-") for line in LINES}

    # Hit ratio against capacity per replica, one panel per fleet size.
    fig, axes = plt.subplots(1, len(sweep.replicas), figsize=(4.2 * len(sweep.replicas), 4))
    for ax, n in zip(list(getattr(axes, "flat", [axes])), sweep.replicas, strict=True):
        for line in LINES:
            pts = sorted(
                (r["frac"], r["hit_ratio"])
                for r in _pick(results, replicas=n, line=line.label, **base)
            )
            ax.plot(
                [100 * x for x, _ in pts],
                [100 * y for _, y in pts],
                styles[line.label],
                marker="o",
                ms=3,
                label=line.label,
            )
        ax.axhline(100 * meta["bound"], color="black", lw=1, ls=":", label="infinite-cache bound")
        ax.set_xscale("log")
        ax.set_xticks([100 * f for f in sweep.fracs], [f"{100 * f:g}%" for f in sweep.fracs])
        ax.minorticks_off()
        ax.set_title(f"{n} replica{'s' if n > 1 else ''}")
        ax.set_xlabel("capacity per replica (% of distinct blocks)")
        ax.set_ylabel("prefix blocks hit (%)")
        ax.grid(alpha=0.3)
    fig.legend(*fig.axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out / PLOTS[0], dpi=110)
    plt.close(fig)

    # TTFT CDF per line at the headline point.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for line in LINES:
        rows = [
            r
            for r in _pick(results, replicas=hr, line=line.label, frac=frac, **base)
            if "ttft_s" in r
        ]
        if not rows or not rows[0]["ttft_s"]:
            continue
        xs = rows[0]["ttft_s"]
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, styles[line.label], label=line.label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF, {hr} replicas, {100 * frac:g}% capacity each")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=110)
    plt.close(fig)

    # Load imbalance per line, at the trace's rate and at the highest offered load.
    loads = [1.0, min(sweep.time_scales)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(loads)
    labels = [line.label for line in LINES[:-1]]
    for k, ts in enumerate(loads):
        vals = [_at(results, label, hr, frac, time_scale=ts)["load_imbalance"] for label in labels]
        xs = [i + k * width for i in range(len(labels))]
        ax.bar(xs, vals, width, label=f"{1 / ts:.3g}x the trace's request rate")
    ax.set_xticks([i + width * (len(loads) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("max / mean prefill busy time")
    ax.set_ylim(bottom=1.0)
    ax.set_title(f"Load imbalance, {hr} replicas, {100 * frac:g}% capacity each")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=110)
    plt.close(fig)

    # Cost saving against the retention TTL.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rets = list(sweep.retentions)
    for line in LINES[:-1]:
        ys = [
            100 * _at(results, line.label, hr, frac, retention=ret)["input_cost_saving"]
            for ret in rets
        ]
        ax.plot(rets, ys, marker="o", label=line.label)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("retention (every request marks its whole prompt)")
    ax.set_ylabel("prompt cost saving vs no caching (%)")
    ax.set_title(f"Billed prompt cost, {hr} replicas, {100 * frac:g}% capacity each")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS[3], dpi=110)
    plt.close(fig)

    # Offered load: hit ratio and p90 TTFT against the request rate.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for line in LINES[:-1]:
        rows = [_at(results, line.label, hr, frac, time_scale=ts) for ts in sweep.time_scales]
        rate = [1 / r["time_scale"] for r in rows]
        a1.plot(rate, [100 * r["ratio_to_bound"] for r in rows], marker="o", label=line.label)
        a2.plot(rate, [r["ttft_p90_s"] for r in rows], marker="o", label=line.label)
    a1.set_ylabel("hit ratio / bound (%)")
    a2.set_ylabel("TTFT p90 (s)")
    for ax in (a1, a2):
        ax.set_xlabel("request rate (x the trace's)")
        ax.grid(alpha=0.3)
    a2.legend(fontsize=8)
    fig.suptitle(f"Offered load, {hr} replicas, {100 * frac:g}% capacity each")
    fig.tight_layout()
    fig.savefig(out / PLOTS[4], dpi=110)
    plt.close(fig)

    # Hit ratio against the host tier's size, one panel per device size.
    hosts = [0.0, *sweep.host_fracs]
    fig, axes = plt.subplots(
        1, len(sweep.headline_fracs), figsize=(6 * len(sweep.headline_fracs), 4.5)
    )
    for ax, dev in zip(list(getattr(axes, "flat", [axes])), sweep.headline_fracs, strict=True):
        for label in sweep.curve_lines:
            ys = [100 * _at(results, label, hr, dev, host=h)["ratio_to_bound"] for h in hosts]
            ax.plot(range(len(hosts)), ys, marker="o", ms=3, label=label)
        for (d, h), goal in TIER_GOALS.items():
            if d == dev and h in hosts:
                ax.plot([hosts.index(h)], [100 * goal], "k*", ms=10, label="goal (shipped)")
        ax.axhline(100, color="black", lw=1, ls=":", label="infinite-cache bound")
        ax.set_xticks(range(len(hosts)), ["none", *[f"{100 * h:g}%" for h in hosts[1:]]])
        ax.set_title(f"{hr} replicas, device {100 * dev:g}% each")
        ax.set_xlabel("host tier per replica (% of distinct blocks)")
        ax.set_ylabel("hit ratio / infinite-cache bound (%)")
        ax.grid(alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    keep = dict(zip(labels, handles, strict=True))
    fig.legend(list(keep.values()), list(keep), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(out / PLOTS[5], dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- summary


def _pct(x: float | None) -> str:
    # NOTE: float noise can print a zero saving as "-0.0%"; round first, then add 0.0.
    return "n/a" if x is None else f"{round(100 * x, 1) + 0.0:.1f}%"


def _sec(x: float | None) -> str:
    # NOTE: a run that served no request (every one rejected) has no TTFT: null in JSON.
    return "n/a" if x is None else f"{x:.3f} s"


def _at(
    results: Sequence[dict[str, Any]], label: str, n: int, frac: float, **kw: Any
) -> dict[str, Any]:
    match = {"retention": "none", "time_scale": 1.0, "seed": 0, "host": 0.0, "disk": 0.0, **kw}
    rows = _pick(results, replicas=n, line=label, frac=frac, **match)
    if not rows:
        raise KeyError(f"no run for {label} at {n} replicas, {frac}")
    return rows[0]


def _summary(results: list[dict[str, Any]], sweep: Sweep, meta: dict[str, Any]) -> str:
    hr = sweep.headline_replicas
    cost = ReplicaCostModel()
    block = cost.block_bytes(512)
    prices = PriceTable()
    t = meta["timing"]
    lines = [
        "# Trace simulator: results",
        "",
        "Generated by `cachepoint sim report` "
        f"({meta['sweep']} sweep) on {meta['machine']}. Do not edit by hand; rerun it.",
        "",
        f"- trace: `{meta['trace']}`, {meta['requests']:,} requests, "
        f"{meta['distinct_blocks']:,} distinct 512-token prefix blocks",
        f"- infinite-cache bound: **{100 * meta['bound']:.1f}%** of prefix blocks",
        f"- full replay, {t['replicas']} replicas at {100 * t['capacity_frac']:g}% each "
        f"({SHIPPED}): **{t['replay_s']:.1f} s** replay + {t['prepare_s']:.1f} s loading "
        f"and hashing = {t['total_s']:.1f} s (target: under 60 s)",
        "",
        f"## Headline: {hr} replicas",
        "",
        "| routing + eviction | capacity/replica | hit ratio | ratio to bound | "
        "seed range | goal | TTFT p50 | p90 | p99 | "
        "queue p99 | imbalance |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for frac in sweep.headline_fracs:
        for line in LINES:
            r = _at(results, line.label, hr, frac)
            ratios = [
                _at(results, line.label, hr, frac, seed=s)["ratio_to_bound"] for s in sweep.seeds
            ]
            hits = [_at(results, line.label, hr, frac, seed=s)["hit_ratio"] for s in sweep.seeds]
            goal = TARGETS.get(frac)
            goal_txt = f"≥{100 * goal:.0f}%" if goal and line.label == SHIPPED else ""
            name = f"**{line.label}** (shipped)" if line.label == SHIPPED else line.label
            if line.reference:
                name += " (clairvoyant reference)"
            lines.append(
                f"| {name} | {100 * frac:g}% | {_pct(sum(hits) / len(hits))} | "
                f"{_pct(sum(ratios) / len(ratios))} | {_pct(min(ratios))}–{_pct(max(ratios))} | "
                f"{goal_txt} | {_sec(r['ttft_p50_s'])} | "
                f"{_sec(r['ttft_p90_s'])} | {_sec(r['ttft_p99_s'])} | "
                f"{_sec(r['queue_p99_s'])} | {r['load_imbalance']:.2f} |"
            )
    lines += [
        "",
        f"Hit ratio and ratio to bound are the mean over seeds {list(sweep.seeds)} (routing "
        "ties are sampled); TTFT, queueing, imbalance and every other table are seed 0.",
        "",
    ]
    lines += _tier_summary(results, sweep, meta)
    prof = meta["profile"]
    lines += [
        "## Where the gap to the bound comes from",
        "",
        f"One pool holding the whole fleet's capacity ({hr} x the per-replica capacity, "
        f"arrivals {hr} x further apart so its one engine is as busy as each replica), "
        "where routing cannot lose a hit, reaches:",
        "",
        "| eviction | "
        + " | ".join(f"{hr} x {100 * f:g}% in one pool" for f in sweep.headline_fracs)
        + " |",
        "|---|" + "---|" * len(sweep.headline_fracs),
    ]
    for label in POOLED:
        cells = [
            _pct(_at(results, label, 1, f * hr, time_scale=float(hr))["ratio_to_bound"])
            for f in sweep.headline_fracs
        ]
        lines.append(f"| {label.split(' + ')[1]} | " + " | ".join(cells) + " |")
    reuse = ", ".join(f"{_pct(p)} after {k + 1}" for k, p in enumerate(prof["reuse_given_uses"]))
    gaps = ", ".join(f"p{round(100 * q)} {g:.0f} s" for q, g in prof["gap_quantiles_s"])
    cap = " and ".join(
        f"{round(hr * f * prof['distinct_blocks']):,} ({100 * f:g}% each)"
        for f in sweep.headline_fracs
    )
    lines += [
        "",
        f"- {_pct(prof['used_once'] / prof['distinct_blocks'])} of the "
        f"{prof['distinct_blocks']:,} distinct blocks are used by one request only.",
        f"- Chance a block is used again, by how often it has been used: {reuse}.",
        f"- At most {prof['max_live_blocks']:,} blocks are ever live at once (will be used "
        f"again), against a fleet capacity of {cap} blocks.",
        f"- Time between two uses of a block: {gaps}.",
        "",
        "A pool that knew which blocks come back would hold every live block; LRU instead",
        "keeps whatever is recent, and most of what is recent is never used again.",
        "",
    ]
    frac = sweep.headline_fracs[0]
    lines += [
        "`oracle` evicts the block whose next use in the trace is furthest away (Belady); it",
        "knows the future and is drawn only to show how much of the gap to the bound is the",
        "pool not knowing which blocks will be reused, rather than routing or mechanics.",
        "",
        f"## Offered load ({hr} replicas, {100 * frac:g}% each)",
        "",
        "| routing + eviction | rate | ratio to bound | TTFT p50 | p90 | p99 | queue p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for ts in sweep.time_scales:
        for line in LINES[:-1]:
            r = _at(results, line.label, hr, frac, time_scale=ts)
            lines.append(
                f"| {line.label} | {1 / ts:.3g}x | {_pct(r['ratio_to_bound'])} | "
                f"{_sec(r['ttft_p50_s'])} | {_sec(r['ttft_p90_s'])} | {_sec(r['ttft_p99_s'])} | "
                f"{_sec(r['queue_p99_s'])} |"
            )
    lines += [
        "",
        f"## Retention and the bill ({hr} replicas, {100 * frac:g}% each)",
        "",
        "Every request marks its whole prompt with the TTL (an agent's last-message",
        "breakpoint); `none` sends no markers, so nothing is billed as cache.",
        "",
        "| routing + eviction | retention | ratio to bound | prompt cost saving | "
        "total bill saving | retain refusals |",
        "|---|---|---|---|---|---|",
    ]
    for ret in sweep.retentions:
        for line in LINES[:-1]:
            r = _at(results, line.label, hr, frac, retention=ret)
            lines.append(
                f"| {line.label} | {ret} | {_pct(r['ratio_to_bound'])} | "
                f"{_pct(r['input_cost_saving'])} | {_pct(r['cost_saving'])} | "
                f"{r['retain_refusals']:,} |"
            )
    lines += [
        "",
        "## Ratio to bound by fleet size and capacity",
        "",
        "| routing + eviction | replicas | "
        + " | ".join(f"{100 * f:g}%" for f in sweep.fracs)
        + " |",
        "|---|---|" + "---|" * len(sweep.fracs),
    ]
    for n in sweep.replicas:
        for line in LINES:
            cells = [_pct(_at(results, line.label, n, f)["ratio_to_bound"]) for f in sweep.fracs]
            lines.append(f"| {line.label} | {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Figures used",
        "",
        f"- cost model `{cost.name}`: {cost.peak_flops / 1e12:g} TFLOPS peak BF16 at "
        f"{100 * cost.prefill_mfu:g}% MFU in prefill, {cost.hbm_bytes_per_s / 1e12:g} TB/s HBM at "
        f"{100 * cost.decode_bw_efficiency:g}% in decode, KV {cost.kv_bytes_per_token // 1024} KiB "
        f"a token; cold prefill of 8,192 tokens = {cost.prefill_s(8192, 0):.3f} s "
        f"({cost.prefill_tokens_per_s():,.0f} tokens/s). See docs/sim.md.",
        f"- KV tiers: PCIe {cost.pcie_bytes_per_s / 1e9:g} GB/s per direction at "
        f"{100 * cost.pcie_efficiency:g}% ({cost.host_promote_bytes_per_s / 1e9:.1f} GB/s host <-> "
        f"device), NVMe {cost.disk_read_bytes_per_s / 1e9:g} / "
        f"{cost.disk_write_bytes_per_s / 1e9:g} GB/s read / write at "
        f"{100 * cost.disk_efficiency:g}%; a 512-token block ({block / 2**20:g} MiB) "
        f"comes back from host memory in {1000 * cost.copy_s('host', 'device', block):.2f} ms "
        f"and from disk in {1000 * cost.copy_s('disk', 'device', block):.1f} ms. "
        "See docs/scaling.md.",
        f"- prices: ${prices.input_per_mtok:g} / ${prices.output_per_mtok:g} per million input / "
        f"output tokens; cache read {prices.cache_read_mult:g}x, 5m write "
        f"{prices.write_5m_mult:g}x, 1h write {prices.write_1h_mult:g}x.",
        "",
        "## Plots",
        "",
    ]
    lines += [f"- [{p}]({p})" for p in PLOTS]
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        f"cachepoint sim report --trace {meta['trace']}"
        + ("" if meta["sweep"] == "full" else " --quick"),
        f"cachepoint sim --trace {meta['trace']} --replicas {hr} --capacity-frac {frac} --json",
        *[
            f"cachepoint sim --trace {meta['trace']} --replicas {hr} --capacity-frac {d:g} "
            f"--host-frac {h:g} --json"
            for d, h in sweep.tier_points
        ],
        "```",
        "",
    ]
    return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.0f} GB"


def _tier_summary(results: list[dict[str, Any]], sweep: Sweep, meta: dict[str, Any]) -> list[str]:
    """The KV tiers section: goals, the routing x eviction x tier-size grid, the host curve."""
    if not sweep.tier_points:
        return []
    hr = sweep.headline_replicas
    lines = [
        "## KV tiers (issue 16)",
        "",
        f"{hr} replicas, seed 0. Device and host capacities per replica as shares of the "
        "distinct blocks; evicted device blocks are demoted to the host tier (its own LRU) "
        "and promoted back over PCIe before the prefill that hits them, which waits for "
        "the copy (TTFT includes it). docs/sim.md describes the model.",
        "",
        "| shipped: " + SHIPPED + " | ratio to bound | goal | met | TTFT p50 | p90 | p99 | "
        "hits from host | promotion wait p50 / p90 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dev, host in sweep.tier_points:
        alone = _at(results, SHIPPED, hr, dev)
        tiered = _at(results, SHIPPED, hr, dev, host=host)
        goal = TIER_GOALS.get((dev, host))
        met = ""
        if goal is not None:
            ok = tiered["ratio_to_bound"] >= goal
            ok = ok and tiered["ttft_p50_s"] < alone["ttft_p50_s"]
            ok = ok and tiered["ttft_p90_s"] < alone["ttft_p90_s"]
            met = "**yes**" if ok else "**no**"
        host_share = tiered["hit_ratio_by_tier"].get("host", 0.0) / (tiered["hit_ratio"] or 1)
        goal_txt = "" if goal is None else f"≥{_pct(goal)}"
        for name, r, g, m in (
            (f"device {100 * dev:g}%", alone, "", ""),
            (f"device {100 * dev:g}% + host {100 * host:g}%", tiered, goal_txt, met),
        ):
            wait = (
                f"{1000 * r['promote_p50_s']:.1f} / {1000 * r['promote_p90_s']:.1f} ms"
                if r.get("promote_p50_s") is not None
                else ""
            )
            lines.append(
                f"| {name} | {_pct(r['ratio_to_bound'])} | "
                f"{g} | {m} | {_sec(r['ttft_p50_s'])} | "
                f"{_sec(r['ttft_p90_s'])} | {_sec(r['ttft_p99_s'])} | "
                f"{_pct(host_share) if r is tiered else ''} | {wait} |"
            )
    lines += [
        "",
        "Met = ratio to bound at least the goal, and TTFT p50 and p90 below device-only at the",
        "same device size.",
    ]
    tt = meta.get("tier_timing")
    if tt:
        lines.append(
            f"Replay of the first point with its host tier: **{tt['replay_s']:.1f} s** "
            "(target: under 60 s; timed alone, before the sweep)."
        )
    lines += [
        "",
        "### Every routing x eviction, with and without the host tier",
        "",
        "| routing + eviction | "
        + " | ".join(
            f"{100 * d:g}% | {100 * d:g}% + {100 * h:g}% | TTFT p50 / p90, {100 * d:g}% | "
            f"TTFT p50 / p90, + {100 * h:g}%"
            for d, h in sweep.tier_points
        )
        + " |",
        "|---|" + "---|---|---|---|" * len(sweep.tier_points),
    ]
    for label in grid_labels(sweep):
        cells = []
        for dev, host in sweep.tier_points:
            a = _at(results, label, hr, dev)
            t = _at(results, label, hr, dev, host=host)
            cells += [
                _pct(a["ratio_to_bound"]),
                _pct(t["ratio_to_bound"]),
                f"{_sec(a['ttft_p50_s'])} / {_sec(a['ttft_p90_s'])}",
                f"{_sec(t['ttft_p50_s'])} / {_sec(t['ttft_p90_s'])}",
            ]
        name = f"**{label}** (shipped)" if label == SHIPPED else label
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    hosts = [0.0, *sweep.host_fracs]
    lines += [
        "",
        "### Ratio to bound by host tier size (hit_ratio_vs_host.png)",
        "",
        "| routing + eviction | device | "
        + " | ".join("none" if h == 0 else f"host {100 * h:g}%" for h in hosts)
        + " |",
        "|---|---|" + "---|" * len(hosts),
    ]
    for dev in sweep.headline_fracs:
        for label in sweep.curve_lines:
            cells = [_pct(_at(results, label, hr, dev, host=h)["ratio_to_bound"]) for h in hosts]
            lines.append(f"| {label} | {100 * dev:g}% | " + " | ".join(cells) + " |")
    if sweep.disk_points:
        lines += [
            "",
            "### With a disk tier behind the host tier (shipped combination)",
            "",
            "| device + host + disk | ratio to bound | served from host / disk | TTFT p50 | p90 | "
            "promotion wait p90 | NVMe busy |",
            "|---|---|---|---|---|---|---|",
        ]
        for dev, host, disk in sweep.disk_points:
            for d in (0.0, disk):
                r = _at(results, SHIPPED, hr, dev, host=host, disk=d)
                by = r["hit_ratio_by_tier"]
                p90 = r.get("promote_p90_s")
                wait = "" if p90 is None else f"{1000 * p90:.1f} ms"
                lines.append(
                    f"| {100 * dev:g}% + {100 * host:g}% + {100 * d:g}% | "
                    f"{_pct(r['ratio_to_bound'])} | {_pct(by.get('host', 0.0))} / "
                    f"{_pct(by.get('disk', 0.0))} of prefix blocks | {_sec(r['ttft_p50_s'])} | "
                    f"{_sec(r['ttft_p90_s'])} | "
                    f"{wait} | "
                    f"{_pct(r['link_busy'].get('nvme', 0.0))} |"
                )
    lines += [
        "",
        "### Tier traffic, shipped combination (all replicas, whole replay)",
        "",
        "| device + host | host hits (blocks) | promoted | demoted into host | dropped from host | "
        "PCIe busy h2d / d2h |",
        "|---|---|---|---|---|---|",
    ]
    for dev, host in sweep.tier_points:
        r = _at(results, SHIPPED, hr, dev, host=host)
        t = r["tiers"].get("host", {})
        busy = r["link_busy"]
        lines.append(
            f"| {100 * dev:g}% + {100 * host:g}% | {t.get('hits', 0):,} | "
            f"{_gb(t.get('promoted_bytes', 0))} | {_gb(t.get('demoted_bytes', 0))} | "
            f"{t.get('dropped', 0):,} blocks | {_pct(busy.get('h2d', 0.0))} / "
            f"{_pct(busy.get('d2h', 0.0))} |"
        )
    lines.append("")
    return lines
