"""Draining a replica: POST /v1/drain, the drain CLI (the pod's
preStop hook) and SIGTERM all stop new work with a clear 503, announce draining in a
heartbeat at once, and let in-flight streams finish before the process exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import nats
import pytest

from cachepoint.engine import Engine
from cachepoint.events import schema
from cachepoint.events.subjects import heartbeat_subject
from cachepoint.replica import prestop as drain_cli
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings

from .conftest import wait_ready

PROMPT = list(range(1, 41))
LONG = {"token_ids": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
TOKEN = "drain-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def test_drain_lets_the_stream_finish_refuses_new_work_and_heartbeats_draining(
    engine: Engine, serve, nats_server
):
    # NOTE: a 30 s heartbeat interval: a draining heartbeat seen within seconds was
    # published by the drain itself, not by the periodic loop.
    settings = ReplicaSettings(
        name="r-drain",
        max_num_batched_tokens=256,
        nats_url=nats_server.url,
        heartbeat_interval_s=30.0,
        internal_token=TOKEN,
    )
    app = create_app(settings, engine)
    url = serve(app)
    beats: list[schema.Heartbeat] = []
    nc = await nats.connect(nats_server.url)

    async def on_beat(msg) -> None:
        beats.append(schema.decode(msg.data, schema.Heartbeat))

    await nc.subscribe(heartbeat_subject("r-drain"), cb=on_beat)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=AUTH) as client:
            async with httpx.AsyncClient(base_url=url) as anonymous:
                guarded = await anonymous.post("/v1/drain", json={"timeout_s": 1})
            assert guarded.status_code == 401  # internal, like /v1/stats
            assert app.state.scheduler.draining is False
            async with client.stream("POST", "/v1/generate", json=LONG) as stream:
                lines = stream.aiter_lines()
                assert json.loads(await anext(lines))["type"] == "prefill_done"
                t0 = time.monotonic()
                drain = asyncio.create_task(client.post("/v1/drain", json={"timeout_s": 60}))
                deadline = time.monotonic() + 5
                while not any(b.draining for b in beats):
                    assert time.monotonic() < deadline, "no draining heartbeat"
                    await asyncio.sleep(0.02)
                refused = await client.post("/v1/generate", json={"token_ids": PROMPT})
                assert refused.status_code == 503, refused.text
                err = refused.json()["error"]
                assert err["type"] == "overloaded_error"
                assert "draining" in err["message"] and "r-drain" in err["message"]
                assert (await client.get("/v1/stats")).json()["draining"] is True
                assert not drain.done()  # it waits for the stream
                rest = [json.loads(line) async for line in lines]
            assert rest[-1]["type"] == "done", rest[-2:]
            assert rest[-1]["response"]["output_tokens"] == 1500
            answer = await asyncio.wait_for(drain, 30)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"drained": True, "in_flight": 0}
            assert time.monotonic() - t0 < 30
            # Heartbeats keep saying so until the process exits.
            await app.state.bus.announce()
            await asyncio.sleep(0.3)
            assert beats[-1].draining is True
    finally:
        await nc.close()


async def test_drain_times_out_with_the_stream_still_in_flight(engine: Engine, serve):
    app = create_app(ReplicaSettings(name="r-slow", max_num_batched_tokens=256), engine)
    url = serve(app)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/generate", json=LONG) as stream:
            lines = stream.aiter_lines()
            assert json.loads(await anext(lines))["type"] == "prefill_done"
            answer = await client.post("/v1/drain", json={"timeout_s": 0.2})
            assert answer.json() == {"drained": False, "in_flight": 1}
        bad = await client.post("/v1/drain", json={"timeout_s": -1})
        assert bad.status_code == 400
        assert "timeout_s" in bad.json()["error"]["message"]


# ----------------------------------------------------------- as a real process

CMD = [sys.executable, "-m", "cachepoint.replica.cli"]
DRAIN = [sys.executable, "-m", "cachepoint.replica.prestop"]


def _start(port: int) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "CACHEPOINT_REPLICA_PORT": str(port),
        "CACHEPOINT_INTERNAL_TOKEN": TOKEN,
        "CACHEPOINT_REPLICA_DRAIN_GRACE_S": "60",
    }
    return subprocess.Popen(
        [*CMD, "--name", "r-proc", "--kv-budget", "16MiB", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate(timeout=30)
    return err


def _drain_cli(port: int, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CACHEPOINT_REPLICA_PORT": str(port), "CACHEPOINT_INTERNAL_TOKEN": token}
    env.pop("CACHEPOINT_REPLICA_INTERNAL_TOKEN", None)
    return subprocess.run([*DRAIN, *args], capture_output=True, text=True, env=env, timeout=90)


def _open_stream(url: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=url, timeout=60, headers=AUTH)
    resp = client.send(client.build_request("POST", "/v1/generate", json=LONG), stream=True)
    assert resp.status_code == 200, resp.read()
    return client, resp


def test_drain_cli_waits_for_the_stream_then_sigterm_exits_at_once(free_port):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port)
    try:
        wait_ready(url, proc, timeout=90)
        wrong = _drain_cli(port, "--timeout", "1", token="not-the-token")
        assert wrong.returncode == drain_cli.EXIT_UNREACHABLE
        assert "401" in wrong.stderr and "Traceback" not in wrong.stderr
        client, stream = _open_stream(url)
        lines = stream.iter_lines()
        assert json.loads(next(lines))["type"] == "prefill_done"
        hook = subprocess.Popen(
            [*DRAIN, "--timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "CACHEPOINT_REPLICA_PORT": str(port),
                "CACHEPOINT_INTERNAL_TOKEN": TOKEN,
            },
        )
        deadline = time.time() + 20
        while httpx.get(f"{url}/readyz").status_code == 200:  # draining: not ready
            assert time.time() < deadline and hook.poll() is None
            time.sleep(0.05)
        assert hook.poll() is None, "the hook returned while a stream was in flight"
        refused = httpx.post(f"{url}/v1/generate", json={"token_ids": PROMPT}, headers=AUTH)
        assert refused.status_code == 503 and "draining" in refused.text
        rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["type"] == "done"
        stream.close()
        client.close()
        out, err = hook.communicate(timeout=60)
        assert hook.returncode == drain_cli.EXIT_DRAINED, err
        assert json.loads(out) == {"event": "drain", "url": url, "drained": True, "in_flight": 0}
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends after the hook
        assert proc.wait(timeout=30) == 0
        assert time.time() - t0 < 10, "nothing was in flight: the exit is quick"
    finally:
        err = _stop(proc)
    assert "Traceback" not in err, err


def test_sigterm_alone_drains_in_flight_streams_before_exiting(free_port):
    """No preStop (a local run, `cachepoint up`): SIGTERM drains by itself."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(port)
    try:
        wait_ready(url, proc, timeout=90)
        client, stream = _open_stream(url)
        lines = stream.iter_lines()
        assert json.loads(next(lines))["type"] == "prefill_done"
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 20
        while httpx.get(f"{url}/readyz").status_code == 200:
            assert time.time() < deadline
            time.sleep(0.05)
        # Still listening while it drains: new work gets the clear 503, not a refusal.
        refused = httpx.post(f"{url}/v1/generate", json={"token_ids": PROMPT}, headers=AUTH)
        assert refused.status_code == 503 and "draining" in refused.text
        rest = [json.loads(line) for line in lines if line]
        assert rest[-1]["type"] == "done", rest[-2:]
        assert rest[-1]["response"]["output_tokens"] == 1500
        stream.close()
        client.close()
        assert proc.wait(timeout=30) == 0
    finally:
        err = _stop(proc)
    events = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    draining = [e for e in events if e.get("event") == "replica_draining"]
    assert draining and draining[0]["why"] == "SIGTERM"
    drained = [e for e in events if e.get("event") == "replica_drained"]
    assert drained and drained[0]["drained"] is True
    assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["--timeout", "soon"], {}, "not a number of seconds"),
        (["--timeout", "99999"], {}, "not within"),
        ([], {}, "--timeout"),
        (["--timeout", "1"], {"CACHEPOINT_REPLICA_PORT": "http"}, "is not a port"),
    ],
)
def test_drain_cli_usage_errors_are_one_line_not_a_traceback(args, env, fragment):
    full = {**os.environ, **env}
    r = subprocess.run([*DRAIN, *args], capture_output=True, text=True, env=full, timeout=60)
    assert r.returncode == drain_cli.EXIT_USAGE
    assert fragment in r.stderr and "Traceback" not in r.stderr


def test_drain_cli_unreachable_replica_exits_3(free_port):
    r = _drain_cli(free_port(), "--timeout", "1")
    assert r.returncode == drain_cli.EXIT_UNREACHABLE
    assert "unreachable" in r.stderr and "Traceback" not in r.stderr


def test_drain_cli_help_names_its_exit_codes():
    r = subprocess.run([*DRAIN, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    assert "preStop" in r.stdout and "--timeout SECONDS" in r.stdout and "3 the replica" in r.stdout
