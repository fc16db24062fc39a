"""A scheduler loop that dies takes the replica out.

In process: the app behind a real uvicorn, heartbeats over a real nats-server; the
loop is killed through the scheduler's fault hook while two requests are in flight.
As a process: `cachepoint-replica` with CACHEPOINT_REPLICA_FAULT_INJECT=loop must fail
the request cleanly, log why, and exit non-zero.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time

import httpx
import nats
import pytest

from cachepoint.engine import Engine
from cachepoint.events import schema
from cachepoint.events.subjects import HEARTBEAT
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.step import StepPlan
from cachepoint.replica.watchdog import EXIT_LOOP_DIED, FAULT_ENV

from .conftest import wait_ready

CMD = [sys.executable, "-m", "cachepoint.replica.cli"]
PROMPT = list(range(1, 61))
LONG = {"token_ids": PROMPT, "max_tokens": 1500, "ignore_eos": True}


async def _until(check, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _fields(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, object]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if isinstance(getattr(r, "fields", None), dict) and r.fields.get("event") == event  # type: ignore[attr-defined]
    ]


async def test_loop_death_fails_requests_stops_heartbeats_fails_readyz_and_asks_to_exit(
    engine: Engine, serve, nats_server, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="cachepoint.replica")
    settings = ReplicaSettings(
        name="r-dies",
        max_num_batched_tokens=256,
        nats_url=nats_server.url,
        heartbeat_interval_s=0.1,
    )
    app = create_app(settings, engine)
    exits: list[int] = []
    app.state.request_exit = exits.append  # what cachepoint.runtime.serve installs in a process
    url = serve(app)
    scheduler = app.state.scheduler

    beats: list[float] = []
    nc = await nats.connect(nats_server.url)

    async def on_beat(msg) -> None:
        if schema.decode(msg.data, schema.Heartbeat).name == "r-dies":
            beats.append(time.monotonic())

    await nc.subscribe(f"{HEARTBEAT}.>", cb=on_beat)
    await nc.subscribe(HEARTBEAT, cb=on_beat)  # the old single subject, before one per replica
    try:
        await _until(lambda: len(beats) >= 2, what="heartbeats")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            plain = asyncio.create_task(client.post("/v1/generate", json=LONG))
            async with client.stream(
                "POST", "/v1/generate", json={**LONG, "stream": True}
            ) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                first = json.loads(await anext(lines))
                assert first["type"] == "prefill_done"
                await _until(lambda: len(scheduler.running) == 2, what="both running")
                assert scheduler.alive

                def die(batch: StepPlan) -> None:
                    raise RuntimeError("injected loop fault")

                scheduler.fault_hook = die
                rest = [json.loads(line) async for line in lines]
            # The streaming request ends with an error line, not a truncated body.
            assert rest[-1]["type"] == "error", rest[-3:]
            assert rest[-1]["error"]["type"] == "api_error"
            assert "scheduler loop stopped" in rest[-1]["error"]["message"]
            # The other one gets a clean 500 api_error envelope.
            r = await asyncio.wait_for(plain, 30)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["type"] == "api_error"
            # Out of service at once: probes fail, new work is refused as retryable.
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            assert "scheduler loop died" in ready.json()["reason"]
            assert (await client.get("/healthz")).status_code == 503
            refused = await client.post("/v1/generate", json={"token_ids": PROMPT})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "overloaded_error"
        # The process was asked to exit, once, non-zero.
        assert exits == [EXIT_LOOP_DIED]
        # No heartbeat after the death: the gateway drops the replica by itself.
        died_at = time.monotonic()
        await asyncio.sleep(1.0)  # ten heartbeat intervals
        assert not [t for t in beats if t > died_at]
    finally:
        await nc.close()

    # The log says what happened: the death with its traceback, and each request.
    dead = [r for r in caplog.records if getattr(r, "fields", {}).get("event") == "loop_died"]
    assert dead and dead[0].exc_info is not None
    assert "injected loop fault" in str(dead[0].exc_info[1])
    assert _fields(caplog, "replica_exit")[0]["exit_code"] == EXIT_LOOP_DIED
    started = _fields(caplog, "replica_started")[0]
    assert started["replica"] == "r-dies" and started["blocks"] == engine.num_blocks
    requests = _fields(caplog, "request")
    assert len(requests) == 2
    for line in requests:
        assert line["status"] == "error"
        assert line["error_type"] == "api_error"
        assert line["prompt_tokens"] == len(PROMPT)
        assert isinstance(line["output_tokens"], int) and line["output_tokens"] >= 1


def _json_lines(text: str) -> list[dict[str, object]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_cli_exits_non_zero_when_its_scheduler_loop_dies(free_port):
    port = free_port()
    flags = ["--name", "cli-dies", "--port", str(port), "--kv-budget", "16MiB"]
    proc = subprocess.Popen(
        [*CMD, *flags, "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", FAULT_ENV: "loop"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=60)
        r = httpx.post(f"{url}/v1/generate", json={"token_ids": PROMPT, "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "api_error"
        assert "scheduler loop stopped" in r.json()["error"]["message"]
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert code == EXIT_LOOP_DIED, err
    lines = _json_lines(err)
    events = {line.get("event"): line for line in lines}
    assert events["replica_started"]["replica"] == "cli-dies"
    assert isinstance(events["replica_started"]["epoch"], int)
    died = events["loop_died"]
    assert died["level"] == "critical"
    assert "InjectedFault" in str(died["traceback"])
    assert events["replica_exit"]["exit_code"] == EXIT_LOOP_DIED
    request = events["request"]
    assert request["status"] == "error" and request["error_type"] == "api_error"
    assert request["prompt_tokens"] == len(PROMPT)
    # Every line on stderr is JSON (uvicorn's own included): one parser reads the log.
    assert all(line.startswith("{") for line in err.splitlines() if line.strip()), err
