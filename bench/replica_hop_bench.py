"""The gateway's hop to a replica with each HTTP client it could use: httpx (the
gateway's until 2026-12-07) and aiohttp (its client for generate calls since), on the
same call the gateway makes, in turns, one process.

Run:  .venv/bin/python bench/replica_hop_bench.py [--calls 1500] [--rounds 2] [--tokens 2000]

The echo replica (no model) runs in its own process on loopback. Each call is what
``ReplicaClient.stream`` sends: ``POST /v1/generate`` with a ``--tokens``-token prompt
encoded by ``encode_request``, streamed back as NDJSON and read to its end. Printed per
call: wall time and this process's CPU time (the part the gateway pays on its event
loop), the mean over ``--calls`` sequential calls after 100 to warm up.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx

from cachepoint.bench.loopback import ECHO_APP, wait_ready
from cachepoint.embedded.stack import free_port
from cachepoint.protocol import (
    PROTOCOL_VERSION,
    VERSION_HEADER,
    BreakpointIn,
    GenerateRequest,
    encode_request,
)

HEADERS = {"content-type": "application/json", VERSION_HEADER: str(PROTOCOL_VERSION)}


async def _timed(one: Callable[[], Awaitable[None]], calls: int) -> tuple[float, float]:
    """(wall ms, CPU ms) a call, over ``calls`` after a warm-up."""
    for _ in range(100):
        await one()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await one()
    return (time.perf_counter() - t0) / calls * 1e3, (time.process_time() - c0) / calls * 1e3


async def with_httpx(url: str, body: bytes, calls: int) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=30) as http:

        async def one() -> None:
            async with http.stream("POST", url, content=body, headers=HEADERS) as r:
                async for _ in r.aiter_bytes():
                    pass

        return await _timed(one, calls)


async def with_aiohttp(url: str, body: bytes, calls: int) -> tuple[float, float]:
    async with aiohttp.ClientSession() as http:

        async def one() -> None:
            async with http.post(url, data=body, headers=HEADERS) as r:
                async for _ in r.content.iter_any():
                    pass

        return await _timed(one, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=1500, help="timed calls per client per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the clients taking turns")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens a call sends")
    args = ap.parse_args()
    if args.calls < 1 or args.rounds < 1 or args.tokens < 2:
        ap.error("--calls and --rounds must be at least 1, --tokens at least 2")
    port = free_port()
    uvicorn = [sys.executable, "-m", "uvicorn", "--factory", ECHO_APP, "--port", str(port)]
    replica = subprocess.Popen([*uvicorn, "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    request = GenerateRequest(
        token_ids=list(range(args.tokens)),
        max_tokens=1,
        stream=True,
        breakpoints=[BreakpointIn(position=args.tokens)],
    )
    body = encode_request(request)
    try:
        wait_ready(url, replica)
        print(f"one generate call, {args.tokens}-token prompt, echo replica, {args.calls} calls")
        print(f"{'round':>5}  {'client':8}{'wall ms':>10}{'CPU ms':>10}")
        totals: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
        for r in range(1, args.rounds + 1):
            for name, run in (("httpx", with_httpx), ("aiohttp", with_aiohttp)):
                wall, cpu = asyncio.run(run(f"{url}/v1/generate", body, args.calls))
                totals[name].append(cpu)
                print(f"{r:>5}  {name:8}{wall:10.3f}{cpu:10.3f}")
        ratio = sum(totals["aiohttp"]) / sum(totals["httpx"])
        print(f"aiohttp's CPU a call: {ratio:.2f}x httpx's")
    finally:
        replica.terminate()
        replica.wait(10)


if __name__ == "__main__":
    main()
