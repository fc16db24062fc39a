"""One tenant's huge request against everyone else's small ones.

Run:  .venv/bin/python bench/noisy_neighbour_bench.py [--window 262144] [--probes-s 0.25]

Three processes on loopback: the echo replica (answers at once), the gateway with
SmolLM2's tokenizer and chat template (as `cachepoint up` runs it: the tiny model's
262,144-token window by default), and this client. For each heavy body below, org A
posts it once while org B sends a 4-token call and this client polls `/healthz`, each
every ``--probes-s`` seconds. Printed per body: A's status and time, the worst and
median latency B and `/healthz` saw while A's request was in the gateway, and the
gateway's peak RSS during it (VmHWM, reset before each body through clear_refs) and
its RSS after.

Heavy bodies:
- big-text: one ~25 MB user text block (valid JSON, under the 32 MiB cap);
- tiny-blocks: one million tiny text blocks (~31 MB);
- wide-schema: a tool whose input_schema has 80,000 properties (~7 MB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from cachepoint.bench.loopback import echo_gateway, reset_peak, seed_orgs, status_kib
from cachepoint.replica.model_source import preset_path

SMALL = {
    "model": "cachepoint-tiny",
    "max_tokens": 1,
    "messages": [{"role": "user", "content": "hi"}],
}


def heavy_bodies() -> dict[str, bytes]:
    word = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "
    big_text = {
        "model": "cachepoint-tiny",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": word * (25 * 2**20 // len(word))}],
    }
    tiny = {
        "model": "cachepoint-tiny",
        "max_tokens": 1,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "x"}] * 1_000_000},
        ],
    }
    props = {f"p{i:05d}": {"type": "string", "description": "a field"} for i in range(80_000)}
    wide = {
        "model": "cachepoint-tiny",
        "max_tokens": 1,
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": props}}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    return {
        name: json.dumps(body).encode()
        for name, body in (("big-text", big_text), ("tiny-blocks", tiny), ("wide-schema", wide))
    }


def probe_during(
    gurl: str, key_b: str, heavy: bytes, key_a: str, every_s: float
) -> tuple[int, float, list[float], list[float], str]:
    """A's status and seconds; B's and /healthz's latencies while A was in flight."""
    result: dict[str, object] = {}

    def post_heavy() -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(
                f"{gurl}/v1/messages",
                content=heavy,
                headers={"x-api-key": key_a, "content-type": "application/json"},
                timeout=600,
            )
            result["status"], result["text"] = r.status_code, r.text[:160]
        except httpx.HTTPError as exc:
            result["status"], result["text"] = -1, repr(exc)
        result["seconds"] = time.perf_counter() - t0

    small: list[float] = []
    health: list[float] = []
    failed: list[int] = []  # B's statuses other than 200
    th = threading.Thread(target=post_heavy)
    with httpx.Client(timeout=120) as c:
        th.start()
        time.sleep(0.05)
        while th.is_alive():
            t0 = time.perf_counter()
            r = c.get(f"{gurl}/healthz")
            health.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            t0 = time.perf_counter()
            r = c.post(f"{gurl}/v1/messages", json=SMALL, headers={"x-api-key": key_b})
            small.append(time.perf_counter() - t0)
            if r.status_code != 200:
                failed.append(r.status_code)
            time.sleep(every_s)
    th.join()
    return (
        int(result["status"]),  # type: ignore[call-overload]
        float(result["seconds"]),  # type: ignore[arg-type]
        small,
        health,
        str(result["text"])
        + (f"; B failed {len(failed)}x: {sorted(set(failed))}" if failed else ""),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--window", type=int, default=262_144, help="the gateway's context window")
    ap.add_argument("--probes-s", type=float, default=0.25, help="pause between probes")
    ap.add_argument("--only", action="append", help="run only this body (repeatable)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="cp-noisy-"))
    db = f"sqlite:///{tmp}/bench.db"
    keys = seed_orgs(db, ["heavy", "neighbour"])
    key_a, key_b = keys["heavy"], keys["neighbour"]
    bodies = heavy_bodies()
    rows = []
    with echo_gateway(
        db,
        tmp,
        ["--model-dir", str(preset_path("smollm2")), "--model", "cachepoint-tiny"],
        {"CACHEPOINT_GATEWAY_MAX_CONTEXT_TOKENS": str(args.window)},
    ) as loop:
        gurl, pid = loop.gateway_url, loop.gateway_pid
        with httpx.Client(timeout=30) as c:
            base = []
            for _ in range(40):
                t0 = time.perf_counter()
                c.post(f"{gurl}/v1/messages", json=SMALL, headers={"x-api-key": key_b})
                base.append(time.perf_counter() - t0)
        idle_ms = statistics.median(base) * 1e3
        rss0 = status_kib(pid, "VmRSS") // 1024
        for name, raw in bodies.items():
            if args.only and name not in args.only:
                continue
            reset_peak(pid)
            status, secs, small, health, text = probe_during(gurl, key_b, raw, key_a, args.probes_s)
            peak = status_kib(pid, "VmHWM") // 1024
            time.sleep(2.0)
            after = status_kib(pid, "VmRSS") // 1024
            rows.append((name, len(raw), status, secs, small, health, peak, after, text))

    print(f"gateway window {args.window} tokens, SmolLM2 tokenizer; idle RSS {rss0} MiB")
    print(f"org B's 4-token call when idle: p50 {idle_ms:.1f} ms")
    head = f"{'body':12}{'MB':>6}{'A':>5}{'A s':>7}{'B max ms':>10}{'B p50':>8}"
    print(head + f"{'hz max ms':>11}{'n':>4}{'peak MiB':>10}{'after MiB':>10}")
    for name, size, status, secs, small, health, peak, after, text in rows:
        bmax = max(small, default=0) * 1e3
        bp50 = statistics.median(small) * 1e3 if small else 0.0
        hmax = max(health, default=0) * 1e3
        print(
            f"{name:12}{size / 2**20:6.1f}{status:5d}{secs:7.2f}{bmax:10.0f}{bp50:8.0f}"
            f"{hmax:11.0f}{len(small):4d}{peak:10d}{after:10d}"
        )
        if status != 200 or "B failed" in text:
            print(f"  A got: {text}")


if __name__ == "__main__":
    main()
