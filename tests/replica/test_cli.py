"""`cachepoint-replica` as a user runs it: a real process, signals included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from .conftest import wait_ready

CMD = [sys.executable, "-m", "cachepoint.replica.cli"]


def test_cli_help_explains_flags():
    out = subprocess.run([*CMD, "--help"], capture_output=True, text=True, check=True).stdout
    flags = ("--name", "--port", "--model-dir", "--tp", "--kv-budget", "--org-retained-share")
    for flag in (*flags, "--decode-steps"):
        assert flag in out


def test_cli_bad_flags_are_clear_errors(tmp_path):
    r = subprocess.run([*CMD, "--kv-budget", "lots"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "not a size" in r.stderr
    r = subprocess.run([*CMD, "--model-dir", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "no config.json" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([*CMD, "--org-retained-share", "2"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "org_retained_share: Input should be less than or equal to 1" in r.stderr
    r = subprocess.run([*CMD, "--decode-steps", "0"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "decode_steps: Input should be greater than or equal to 1" in r.stderr


def test_a_budget_that_cannot_hold_the_model_is_one_line_not_a_traceback(free_port):
    argv = [*CMD, "--kv-budget", "1MiB", "--max-model-len", "100000", "--port", str(free_port())]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "cannot start: KV budget of 1.0 MiB" in r.stderr
    assert "raise the budget or lower max_model_len" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_serves_generate_and_stats_then_stops_on_sigterm(free_port):
    port = free_port()
    proc = subprocess.Popen(
        [*CMD, "--name", "cli-r", "--port", str(port), "--kv-budget", "16MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=60)
        r = httpx.post(f"{url}/v1/generate", json={"token_ids": list(range(40)), "max_tokens": 3})
        assert r.status_code == 200
        assert r.json()["output_tokens"] == 3
        stats = httpx.get(f"{url}/v1/stats").json()
        assert stats["replica"] == "cli-r"
        assert stats["query_tokens"] == 40
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn drains, then re-raises the signal so the exit status says SIGTERM.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out
    assert "Traceback" not in out
    # The log is JSON lines: startup, then one line per finished request.
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    started = next(line for line in lines if line.get("event") == "replica_started")
    assert started["replica"] == "cli-r" and started["model"] == "cachepoint-tiny"
    assert started["blocks"] > 0 and isinstance(started["epoch"], int)
    (request,) = [line for line in lines if line.get("event") == "request"]
    assert request["status"] == "ok" and request["error_type"] is None
    assert request["stop_reason"] == "max_tokens"
    assert request["prompt_tokens"] == 40 and request["output_tokens"] == 3
    assert request["engine_hit_tokens"] == 0 and request["written_5m_tokens"] == 0
    assert request["queue_s"] >= 0 and request["prefill_s"] > 0 and request["decode_s"] > 0
