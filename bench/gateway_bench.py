"""The gateway's own overhead: the same request through the gateway and straight to a
replica that answers at once (the echo replica), side by side in one run.

Run:  .venv/bin/python bench/gateway_bench.py [--requests 400] [--concurrency 16] [--diagnostics]

Three processes on loopback: the echo replica, the gateway (SQLite ledger, WAL), and
this client. The direct call sends the gateway's own rendered payload to the replica,
so the difference is everything the gateway adds: auth, render, the cache_control
contract, the hop, billing (a committed ledger row per request) and the response.

With --diagnostics every gateway request opts in to cache diagnostics, naming the
previous response's id (the sequential phase; null in the throughput phase): its
fingerprint is built, kept (a row per request) and compared. The fingerprint's size
for the prompt is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from cachepoint.bench.loopback import echo_gateway, seed_orgs
from cachepoint.gateway.contract.fingerprint import fingerprint
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.tokenizer import ByteTokenizer

SYSTEM = "You are a careful assistant for a hardware store. " * 40
BODY = {
    "model": "cachepoint-tiny",
    "max_tokens": 1,
    "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": "Do you sell 10mm hex bolts?"}],
}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def sequential(
    client: httpx.Client, url: str, body: dict, headers: dict, n: int, chain: bool = False
) -> list[float]:
    """``n`` requests one after another; ``chain``: each names the previous answer's id
    in ``diagnostics`` (the body must carry a ``diagnostics`` object)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(url, json=body, headers=headers)
        out.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.text[:200]}")
        if chain:
            body = {**body, "diagnostics": {"previous_message_id": r.json()["id"]}}
    return out


async def throughput(url: str, body: dict, headers: dict, conc: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=conc)) as c:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                r = await c.post(url, json=body, headers=headers)
                if r.status_code == 200:
                    done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(conc)])
        return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="sequential requests per side")
    ap.add_argument("--concurrency", type=int, default=16, help="clients for the RPS phase")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each RPS phase")
    ap.add_argument(
        "--diagnostics",
        action="store_true",
        help="every gateway request opts in to cache diagnostics (fingerprint kept and compared)",
    )
    args = ap.parse_args()
    body = dict(BODY)
    if args.diagnostics:
        body["diagnostics"] = {"previous_message_id": None}

    tmp = Path(tempfile.mkdtemp(prefix="cp-gw-bench-"))
    db = f"sqlite:///{tmp}/bench.db"
    key = seed_orgs(db, ["bench"])["bench"]
    with echo_gateway(db, tmp, ["--min-cacheable-tokens", "64"]) as loop:
        rurl, gurl = loop.replica_url, loop.gateway_url
        rendered = Renderer(ByteTokenizer()).render(MessagesRequest.model_validate(BODY))
        direct_body = {
            "token_ids": rendered.tokens.tolist(),
            "max_tokens": 1,
            "breakpoints": [{"position": rendered.blocks[0].end}],
        }
        headers = {"x-api-key": key}
        with httpx.Client(timeout=30) as c:
            for _ in range(50):  # warm both paths
                c.post(f"{rurl}/v1/generate", json=direct_body)
                c.post(f"{gurl}/v1/messages", json=body, headers=headers)
            direct: list[float] = []
            via: list[float] = []
            for _ in range(4):  # interleave so drift hits both sides alike
                direct += sequential(c, f"{rurl}/v1/generate", direct_body, {}, args.requests // 4)
                via += sequential(
                    c, f"{gurl}/v1/messages", body, headers, args.requests // 4, args.diagnostics
                )
        rps_direct = asyncio.run(
            throughput(f"{rurl}/v1/generate", direct_body, {}, args.concurrency, args.seconds)
        )
        rps_via = asyncio.run(
            throughput(f"{gurl}/v1/messages", body, headers, args.concurrency, args.seconds)
        )

    print(f"gateway overhead: {len(rendered)}-token prompt with one breakpoint, echo replica")
    if args.diagnostics:
        fp = fingerprint(rendered, model=BODY["model"], params=0, cached_end=0, block_size=16)
        print(f"with cache diagnostics: a {len(fp.encode())}-byte fingerprint a request")
    print(f"{'':24}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, xs in (("direct to replica", direct), ("through the gateway", via)):
        p50_, p99_, mean_ = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3, statistics.mean(xs) * 1e3
        print(f"{name:24}{p50_:10.2f}{p99_:10.2f}{mean_:10.2f}")
    p50 = (pct(via, 50) - pct(direct, 50)) * 1e3
    p99 = (pct(via, 99) - pct(direct, 99)) * 1e3
    print(f"{'added by the gateway':24}{p50:10.2f}{p99:10.2f}")
    print(
        f"throughput with {args.concurrency} clients: direct {rps_direct:.0f} req/s, "
        f"through the gateway {rps_via:.0f} req/s"
    )
    print(f"target p50 overhead < 3 ms: {'met' if p50 < 3 else 'MISSED'}")


if __name__ == "__main__":
    main()
