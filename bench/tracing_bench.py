"""Tracing overhead: the demo workload through two identical embedded stacks, one with
tracing on (spans to the local span files, as `cachepoint up` runs) and one with it
off, requests interleaved so both see the same machine load.

Run:  .venv/bin/python bench/tracing_bench.py [--sessions 8] [--turns 12]

The workload is the demo's (`cachepoint up --demo`): tools, a global 1h system
prompt and a dynamic tail, tool_use / tool_result turns with the breakpoint on the
last message, streamed, 24 output tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import anthropic
import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachepoint.embedded.demo_session import (
    MAX_TOKENS,
    SCOPE_BETA,
    TOOLS,
    assistant_turn,
    next_request,
    system_blocks,
)
from cachepoint.embedded.stack import Stack, free_port


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stack_cpu(stack: Stack) -> dict[str, float]:
    return {c.name: cpu_s(c.proc.pid) for c in stack.children if c.proc.poll() is None}


HISTOGRAMS = (
    # (process, metric): the stacks' own histograms say where a difference arises
    ("gateway", "cachepoint_gateway_overhead_seconds"),
    ("gateway", "cachepoint_gateway_upstream_seconds"),
    ("replica-0", "cachepoint_ttft_seconds"),
    ("replica-0", "cachepoint_decode_seconds"),
)


def histogram_sums(stack: Stack) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in HISTOGRAMS, scraped from /metrics."""
    urls = {c.name: c.url for c in stack.children}
    urls["gateway"] = stack.metrics_url  # the gateway's /metrics has its own listener
    out: dict[str, tuple[float, float]] = {}
    for proc, metric in HISTOGRAMS:
        text = httpx.get(f"{urls[proc]}/metrics", timeout=10).text
        total = count = 0.0
        for family in text_string_to_metric_families(text):
            if family.name != metric:
                continue
            for sample in family.samples:
                if sample.name == metric + "_sum":
                    total += sample.value
                elif sample.name == metric + "_count":
                    count += sample.value
        out[metric] = (total, count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=12, help="as the demo (12)")
    ap.add_argument(
        "--noise-floor", action="store_true", help="both stacks untraced: the A/A difference"
    )
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="as the demo (24)")
    args = ap.parse_args()
    # --noise-floor runs the same comparison with tracing off on both sides (an A/A
    # test): how far apart two identical stacks land on this machine.
    on_tracing = not args.noise_floor
    stacks = {
        "on": Stack(
            Path(tempfile.mkdtemp(prefix="cp-trace-on-")),
            replicas=1,
            port=free_port(),
            tracing=on_tracing,
        ),
        "off": Stack(
            Path(tempfile.mkdtemp(prefix="cp-trace-off-")),
            replicas=1,
            port=free_port(),
            tracing=False,
        ),
    }
    for s in stacks.values():
        s.start()
    try:
        clients = {
            k: anthropic.Anthropic(base_url=s.base_url, api_key=s.keys["api_key"])
            for k, s in stacks.items()
        }
        lat: dict[str, list[float]] = {"on": [], "off": []}
        cpu0 = {k: stack_cpu(s) for k, s in stacks.items()}
        hist0 = {k: histogram_sums(s) for k, s in stacks.items()}
        system = system_blocks()
        for sid in range(args.sessions):
            messages: list[dict] = []
            tool_id = None
            for turn in range(1, args.turns + 1):
                next_request(messages, turn, tool_id)
                order = ("on", "off") if (sid + turn) % 2 == 0 else ("off", "on")
                for which in order:
                    # The demo's request: streamed, with its tools, betas and max_tokens.
                    t0 = time.perf_counter()
                    with clients[which].messages.stream(
                        model="cachepoint-tiny",
                        max_tokens=args.max_tokens,
                        tools=TOOLS,
                        system=system,
                        messages=messages,
                        extra_body={"temperature": 0.0},
                        extra_headers={"anthropic-beta": SCOPE_BETA},
                    ) as stream:
                        stream.until_done()
                    lat[which].append(time.perf_counter() - t0)
                # Both stacks see the same history: a fixed reply, as the demo's shape.
                reply, tool_id = assistant_turn(turn, f"Step {turn} done.")
                messages.append(reply)
        cpu1 = {k: stack_cpu(s) for k, s in stacks.items()}
        hist1 = {k: histogram_sums(s) for k, s in stacks.items()}
    finally:
        for s in stacks.values():
            s.stop()

    n = len(lat["on"])
    print(
        f"tracing overhead: {n} requests per side ({args.sessions} sessions x {args.turns} "
        f"turns of the demo workload, {args.max_tokens} output tokens), one replica each"
    )
    print(f"{'':12}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}")
    for k in ("off", "on"):
        xs = lat[k]
        print(
            f"tracing {k:4}{statistics.mean(xs) * 1e3:10.2f}{pct(xs, 50) * 1e3:10.2f}"
            f"{pct(xs, 90) * 1e3:10.2f}"
        )
    print("CPU ms per request, by process:")
    for k in ("off", "on"):
        per = {name: (cpu1[k][name] - cpu0[k][name]) * 1e3 / len(lat[k]) for name in cpu1[k]}
        print(f"  tracing {k:4}" + "".join(f"  {name} {ms:6.2f}" for name, ms in per.items()))
    print("mean ms per request, from each stack's own histograms:")
    for k in ("off", "on"):
        parts = []
        for _, metric in HISTOGRAMS:
            (s1, c1), (s0, c0) = hist1[k][metric], hist0[k][metric]
            mean = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else float("nan")
            parts.append(
                f"  {metric.removeprefix('cachepoint_').removesuffix('_seconds')} {mean:6.2f}"
            )
        print(f"  tracing {k:4}" + "".join(parts))
    # Each turn ran on both stacks back to back with the same prompt: the per-turn
    # ratio cancels the turn-to-turn spread that the unpaired medians keep.
    ratios = [a / b for a, b in zip(lat["on"], lat["off"], strict=True)]
    paired = statistics.median(ratios) - 1
    rng = random.Random(0)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) - 1 for _ in range(2000))
    print(
        f"paired: median per-turn overhead {paired:+.1%} "
        f"(95% bootstrap interval {boots[50]:+.1%} .. {boots[1949]:+.1%})"
    )
    over = statistics.mean(lat["on"]) / statistics.mean(lat["off"]) - 1
    over50 = pct(lat["on"], 50) / pct(lat["off"], 50) - 1
    print(
        f"overhead: {over:+.1%} on the mean, {over50:+.1%} on the median "
        f"(target < 5% on both: {'met' if max(over, over50) < 0.05 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
