"""Which policy is "load-penalized longest match with LRU", and does the default beat it?

Run:  .venv/bin/python bench/sim_baseline.py [--trace FILE] [--fracs 0.01 0.005]
          [--seeds 0 1 2] [--variant SPEC ...] [--host-mult K] [--time-scale X]

The shipped default must be at least as good as the simplest baseline,
"load-penalized longest match with LRU". In `cachepoint.routing` that is
`CacheAwarePolicy`: score = prefix tokens the replica holds (longest match) −
``load_weight`` × its queued prefill tokens. Its load weight is a free parameter, so
this script replays the trace once per variant (the trace is loaded and hashed once)
and prints the ratio to the infinite-cache bound and the TTFT of each.

A variant is ``POLICY[:KEY=VALUE,...]+EVICTION``, for instance
``cache_aware:load_weight=0.25+lru``; option values are parsed as numbers.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cachepoint.sim.cli import SHIPPED_EVICTION, SHIPPED_POLICY, default_trace
from cachepoint.sim.simulator import PreparedTrace, SimConfig, Simulator
from cachepoint.sim.trace import load_trace

DEFAULT_VARIANTS = (
    "cache_aware:load_weight=0+lru",  # longest match, load only breaks ties
    "cache_aware:load_weight=0.1+lru",
    "cache_aware:load_weight=0.25+lru",
    "cache_aware+lru",  # load_weight 0.5: the gateway's scoring, the report's baseline
    "cache_aware:load_weight=1+lru",
    "prefix_affinity+lru",
    f"{SHIPPED_POLICY}+{SHIPPED_EVICTION}",  # what ships
    "prefix_affinity+reuse_credit",
)


def parse_variant(spec: str) -> tuple[str, dict[str, Any], str]:
    """``POLICY[:K=V,...]+EVICTION`` -> (policy, options, eviction); ValueError when malformed."""
    head, sep, eviction = spec.rpartition("+")
    if not sep or not head or not eviction:
        raise ValueError(f"variant {spec!r}: expected POLICY[:K=V,...]+EVICTION")
    policy, _, opts = head.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {spec!r}: option {item!r} is not KEY=VALUE")
        try:
            options[key] = int(value)
        except ValueError:
            try:
                options[key] = float(value)
            except ValueError:
                raise ValueError(f"variant {spec!r}: {key} is not a number") from None
    return policy, options, eviction


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=default_trace())
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.01])
    ap.add_argument(
        "--host-mult", type=float, default=0.0, help="host tier = K x the device capacity (0)"
    )
    ap.add_argument("--time-scale", type=float, default=1.0, help="arrival time multiplier (1)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variant", action="append", help="POLICY[:K=V,...]+EVICTION (repeatable)")
    args = ap.parse_args(argv)
    if not args.trace:
        ap.error("no trace found; pass --trace FILE")
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    t0 = time.perf_counter()
    prepared = PreparedTrace.build(load_trace(args.trace))
    print(f"prepared {args.trace} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print("| routing + eviction | device + host | ratio to bound (mean; seeds) | TTFT p50 | p90 |")
    print("|---|---|---|---|---|")
    for frac in args.fracs:
        for (policy, options, eviction), spec in zip(
            variants, args.variant or DEFAULT_VARIANTS, strict=True
        ):
            ratios, first = [], None
            for seed in args.seeds:
                cfg = SimConfig(
                    replicas=args.replicas,
                    capacity_frac=frac,
                    host_frac=args.host_mult * frac,
                    policy=policy,
                    policy_options=options,
                    eviction=eviction,
                    time_scale=args.time_scale,
                    seed=seed,
                )
                res = Simulator(prepared, cfg).run()
                ratios.append(res.ratio_to_bound)
                first = first or res
            assert first is not None
            seeds = " / ".join(f"{100 * r:.1f}" for r in ratios)
            print(
                f"| {spec} | {100 * frac:g}% + {100 * args.host_mult * frac:g}% | "
                f"{100 * sum(ratios) / len(ratios):.1f} % "
                f"({seeds}) | {first.ttft_p50_s:.3f} s | {first.ttft_p90_s:.3f} s |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
