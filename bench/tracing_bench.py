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
import statistics
import tempfile
import time
from pathlib import Path

import anthropic

from cachepoint.demo_session import (
    MAX_TOKENS,
    SCOPE_BETA,
    TOOLS,
    assistant_turn,
    next_request,
    system_blocks,
)
from cachepoint.stack import Stack, free_port


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


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
    over = statistics.mean(lat["on"]) / statistics.mean(lat["off"]) - 1
    over50 = pct(lat["on"], 50) / pct(lat["off"], 50) - 1
    print(
        f"overhead: {over:+.1%} on the mean, {over50:+.1%} on the median "
        f"(target < 5% on both: {'met' if max(over, over50) < 0.05 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
