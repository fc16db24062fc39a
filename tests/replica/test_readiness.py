"""Readiness means "loaded and serving", never "not busy".

A probe that failed while the waiting queue was full made a rolling update under load
count every busy member as broken, and a replica with max_waiting 0 never ready.
Overload is signalled by 429s and the heartbeats' waiting/max_waiting instead.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from cachepoint.engine import Engine
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings

PROMPT = list(range(1, 41))
LONG = {"token_ids": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}


async def _until(check, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_readyz_stays_ready_while_the_waiting_queue_is_full(engine: Engine, serve):
    settings = ReplicaSettings(
        name="r-full", max_num_batched_tokens=256, max_num_seqs=1, max_waiting=1
    )
    app = create_app(settings, engine)
    url = serve(app)
    scheduler = app.state.scheduler
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/generate", json=LONG) as running:
            lines = running.aiter_lines()
            assert json.loads(await anext(lines))["type"] == "prefill_done"
            # max_num_seqs 1: the next request waits, and the queue (1) is then full.
            queued = asyncio.create_task(
                client.post("/v1/generate", json={"token_ids": PROMPT, "max_tokens": 2})
            )
            await _until(lambda: len(scheduler.waiting) == 1)
            refused = await client.post("/v1/generate", json={"token_ids": PROMPT})
            assert refused.status_code == 429, refused.text  # overload: a 429 ...
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text  # ... never unreadiness
            assert ready.json()["status"] == "ready"
            stats = (await client.get("/v1/stats")).json()
            assert (stats["waiting"], stats["max_waiting"]) == (1, 1)  # what routing sees
        queued.cancel()


def test_max_waiting_zero_is_refused_with_a_reason() -> None:
    # A replica with no queue answered 429 to every request while reporting ready (every
    # request waits, at least for the next step): refused at start instead.
    with pytest.raises(ValidationError, match="max_waiting"):
        ReplicaSettings(name="r-zero", max_waiting=0)
    assert ReplicaSettings(name="r-one", max_waiting=1).max_waiting == 1


def test_readyz_fails_while_draining_and_healthz_does_not(engine: Engine, serve):
    app = create_app(ReplicaSettings(name="r-drains"), engine)
    url = serve(app)
    assert httpx.get(f"{url}/readyz").status_code == 200
    r = httpx.post(f"{url}/v1/drain", json={"timeout_s": 0})
    assert r.json() == {"drained": True, "in_flight": 0}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 503
    assert "draining" in ready.json()["reason"]
    assert httpx.get(f"{url}/healthz").status_code == 200  # alive: no restart wanted
