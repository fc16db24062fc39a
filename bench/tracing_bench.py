"""Tracing overhead: the demo workload through two identical embedded stacks, one with
tracing on (spans to the local span files, as `cachepoint up` runs) and one with it
off, requests interleaved so both see the same machine load.

Run:  .venv/bin/python bench/tracing_bench.py [--sessions 4] [--turns 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anthropic

from cachepoint.demo_session import SCOPE_BETA, STATIC_SYSTEM, TOOLS
from cachepoint.stack import Stack, free_port


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    stacks = {
        "on": Stack(Path(tempfile.mkdtemp(prefix="cp-trace-on-")), replicas=1, port=free_port()),
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
        system = [
            {
                "type": "text",
                "text": STATIC_SYSTEM,
                "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"},
            }
        ]
        for sid in range(args.sessions):
            history: list[dict] = []
            for turn in range(args.turns):
                for m in history:
                    for b in m["content"]:
                        b.pop("cache_control", None)
                history.append(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "text",
                                "text": f"session {sid} step {turn}: read the next file.",
                                "cache_control": {"type": "ephemeral"},
                            }
                        ],
                    }
                )
                order = ("on", "off") if (sid + turn) % 2 == 0 else ("off", "on")
                for which in order:
                    t0 = time.perf_counter()
                    clients[which].messages.create(
                        model="cachepoint-tiny",
                        max_tokens=args.max_tokens,
                        tools=TOOLS,
                        system=system,
                        messages=history,
                        extra_body={"temperature": 0.0},
                        extra_headers={"anthropic-beta": SCOPE_BETA},
                    )
                    lat[which].append(time.perf_counter() - t0)
                history.append(
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": f"Step {turn} done."}],
                    }
                )
    finally:
        for s in stacks.values():
            s.stop()

    n = len(lat["on"])
    print(
        f"tracing overhead: {n} requests per side ({args.sessions} sessions x {args.turns} "
        f"turns, demo prompts, {args.max_tokens} output tokens), one replica each"
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
