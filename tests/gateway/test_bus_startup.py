"""The gateway's first look at its static replicas (gateway/fleet/bus.py): a replica
that is up but slow to answer its first /v1/stats (a loaded host) is still known when
the gateway opens, while one that is down costs no wait."""

from __future__ import annotations

import asyncio
import time

import httpx
from fastapi import FastAPI

from cachepoint.gateway.fleet.bus import GatewayBus
from cachepoint.gateway.fleet.directory import ReplicaDirectory

STATS = {
    "replica": "r0",
    "epoch": 1,
    "block_size": 16,
    "model": "cachepoint-tiny",
    "queued_prefill_tokens": 0,
    "running": 0,
    "waiting": 0,
    "max_waiting": 64,
}


def slow_replica(delay_s: float) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/stats")
    async def stats() -> dict:
        await asyncio.sleep(delay_s)
        return STATS

    return app


async def opened(urls: list[str]) -> tuple[ReplicaDirectory, float]:
    directory = ReplicaDirectory(block_size=16)
    async with httpx.AsyncClient() as http:
        bus = GatewayBus(directory, None, http, seed_urls=urls)
        t0 = time.monotonic()
        await bus.start()
        took = time.monotonic() - t0
        await bus.stop()
    return directory, took


def test_a_replica_slower_than_a_routine_poll_is_known_at_start(serve):
    # NOTE: 1.5 s is past a routine poll's 1 s timeout, which is what a busy 2-core CI
    # host once gave a fresh replica: the gateway opened knowing none and answered 503.
    url = serve(slow_replica(1.5))
    directory, took = asyncio.run(opened([url]))
    assert [v.name for v in directory.views("cachepoint-tiny")] == ["r0"]
    assert took >= 1.5


def test_a_replica_that_is_down_does_not_hold_the_start(free_port):
    directory, took = asyncio.run(opened([f"http://127.0.0.1:{free_port()}"]))
    assert directory.views("cachepoint-tiny") == []
    assert took < 1.0
