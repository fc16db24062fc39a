"""A gateway killed -9 with a keyed stream in flight, on the real
embedded stack: its supervisor restarts the gateway, and the client's retry with the
same idempotency key is taken over once the dead gateway's lease lapsed. It completes
within the lease plus one upstream timeout (before: 409 "still in progress" after
the upstream timeout, for an hour), and the ledger holds exactly one row for the
logical call's generation plus the cut attempt, billed what it delivered (before:
nothing)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
import uuid
from typing import Any

import anthropic
import httpx
import pytest

from cachepoint.embedded.stack import Stack

from .test_supervise import _wait
from .test_up import _alive

LEASE_S = 3
UPSTREAM_TIMEOUT_S = 30
MAX_TOKENS = 1500  # ~6 s of the tiny random model here: long enough to be cut


def _cut_stream(stack: Stack, key: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream ``body``; kill -9 the gateway once deltas have flowed for 2.5 s. What the
    client saw: request id, message_start usage, delta arrival times and text."""
    headers = {
        "x-api-key": stack.keys["api_key"],
        "anthropic-version": "2023-06-01",
        "idempotency-key": key,
    }
    gateway = next(c for c in stack.children if c.name == "gateway")
    seen: dict[str, Any] = {"deltas": [], "text": "", "killed_at": None}
    url = f"{stack.base_url}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        seen["request_id"] = r.headers["request-id"]
        event = None
        try:
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "message_start":
                    seen["usage"] = json.loads(line[6:])["message"]["usage"]
                elif line.startswith("data: ") and event == "content_block_delta":
                    seen["deltas"].append(time.monotonic())
                    seen["text"] += json.loads(line[6:])["delta"]["text"]
                    if seen["killed_at"] is None and time.monotonic() - seen["deltas"][0] > 2.5:
                        seen["killed_at"] = time.monotonic()
                        seen["pid"] = gateway.pid
                        os.kill(gateway.pid, signal.SIGKILL)
                elif event == "message_stop":
                    pytest.fail("the stream ended before the gateway was killed")
        except httpx.HTTPError:
            pass  # the connection died with the gateway
    assert seen["killed_at"] is not None
    return seen


def _rows(stack: Stack, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(stack.state_dir / "cachepoint.db")
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_retry_after_a_gateway_kill_takes_the_key_over_billed_once(
    tmp_path, free_port, monkeypatch
):
    # NOTE: the children inherit this environment, the restarted gateway too.
    monkeypatch.setenv("CACHEPOINT_GATEWAY_IDEMPOTENCY_LEASE_S", str(LEASE_S))
    monkeypatch.setenv("CACHEPOINT_GATEWAY_UPSTREAM_TIMEOUT_S", str(UPSTREAM_TIMEOUT_S))
    stack = Stack(
        state_dir=tmp_path / "state",
        replicas=1,
        port=free_port(),
        tracing=False,
        min_cacheable_tokens=64,
    )
    stack.start()
    pids = {c.pid for c in stack.children}
    try:
        model = stack.served_model()
        key = f"crash-{uuid.uuid4()}"
        messages = [{"role": "user", "content": "Tell me everything about kettles. " * 8}]
        # NOTE: greedy, so the turn is the same on every run: sampled at temperature 1,
        # the random model ends its turn on a sampled EOS now and then (seen in CI: 560
        # tokens), which would end the stream before the kill or the retry early.
        body = {
            "model": model,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "messages": messages,
        }
        cut = _cut_stream(stack, key, body)
        gateway = next(c for c in stack.children if c.name == "gateway")
        _wait(lambda: gateway.pid != cut["pid"], 15, "the gateway to be spawned again")
        pids.add(gateway.pid)
        _wait(
            lambda: httpx.get(f"{stack.base_url}/readyz", timeout=2).json()["replicas_live"] == 1,
            90,
            "the restarted gateway to be ready",
        )
        # The dead gateway's row is still in flight, as it left it.
        ((owner, status),) = _rows(stack, "SELECT request_id, status FROM idempotency_keys")
        assert (owner, status) == (cut["request_id"], None)

        client = anthropic.Anthropic(
            base_url=stack.base_url, api_key=stack.keys["api_key"], max_retries=0, timeout=60
        )
        t0 = time.monotonic()
        with client.messages.stream(
            model=model,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},  # greedy; the SDK names no temperature
            messages=messages,
            extra_headers={"idempotency-key": key},
        ) as s:
            final = s.get_final_message()
            retry_headers = s.response.headers
        took = time.monotonic() - t0
        print(f"retry after the crash completed in {took:.2f} s (lease {LEASE_S} s)")
        assert took < LEASE_S + UPSTREAM_TIMEOUT_S, took
        assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", MAX_TOKENS)
        assert "idempotent-replayed" not in retry_headers  # generated afresh, not replayed
        retry_id = retry_headers["request-id"]
        assert retry_id != cut["request_id"]

        rows = {
            r[0]: r[1:]
            for r in _rows(
                stack,
                "SELECT request_id, input_tokens, cache_read_input_tokens,"
                " cache_write_5m_tokens, cache_write_1h_tokens, output_tokens FROM usage",
            )
        }
        # One row for the logical call's generation, one for the cut attempt: no other.
        assert set(rows) == {retry_id, cut["request_id"]}, rows
        u = final.usage
        assert rows[retry_id] == (
            u.input_tokens,
            u.cache_read_input_tokens,
            u.cache_creation.ephemeral_5m_input_tokens,
            u.cache_creation.ephemeral_1h_input_tokens,
            MAX_TOKENS,
        )
        # The cut attempt: the input buckets its message_start reported, and output
        # tokens within what it delivered: at least the deltas the client had a second
        # and a half before the kill (its progress is written at most 1 s apart), at
        # most the bytes of text it received (a byte-level BPE token is at least one
        # byte), and short of the whole generation.
        *cut_inputs, cut_output = rows[cut["request_id"]]
        su = cut["usage"]
        assert cut_inputs == [
            su["input_tokens"],
            su["cache_read_input_tokens"],
            su["cache_creation"]["ephemeral_5m_input_tokens"],
            su["cache_creation"]["ephemeral_1h_input_tokens"],
        ]
        recorded_by = cut["killed_at"] - 1.5
        floor = sum(t <= recorded_by for t in cut["deltas"])
        assert floor > 0
        assert floor <= cut_output <= len(cut["text"].encode()), (floor, cut_output)
        assert cut_output < MAX_TOKENS

        # The key now holds the retry's outcome: a third call replays it, unbilled.
        ((owner, status),) = _rows(stack, "SELECT request_id, status FROM idempotency_keys")
        assert (owner, status) == (retry_id, 200)
        with client.messages.stream(
            model=model,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},  # greedy; the SDK names no temperature
            messages=messages,
            extra_headers={"idempotency-key": key},
        ) as s:
            again = s.get_final_message()
            assert s.response.headers["idempotent-replayed"] == "true"
        assert again.id == final.id
        assert len(_rows(stack, "SELECT request_id FROM usage")) == 2
    finally:
        stack.stop()
    time.sleep(0.3)
    assert not [p for p in pids if _alive(p)], "orphan processes left"
