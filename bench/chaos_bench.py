"""Faults under load: agent sessions through the embedded stack while a replica is
killed (-9) and NATS is killed, both restarted by the stack's supervisor.

Run:  .venv/bin/python bench/chaos_bench.py [--sessions 16] [--duration 60] [--json FILE]

N concurrent agent sessions (the `cachepoint up --demo` requests, through the official
``anthropic`` SDK with its default retries and one ``idempotency-key`` per logical
call; even sessions stream, odd ones do not) run for D seconds. At 25% of D replica-0
gets SIGKILL, at 60% nats-server does. Every call has a wall-clock limit; one that
passes it is a hang. Afterwards the ledger (SQLite, from endpoint.json's db_url) is
compared with what the client saw, attempt by attempt (an httpx hook records each
HTTP attempt's request id):

- hangs: calls that did not finish within the limit;
- unclean failures: anything but an Anthropic error type (an APIStatusError or an SSE
  ``error`` event), a 500 "internal error", a reset connection, a truncated stream;
- usage: per bucket, the client's sum equals the ledger's; completed calls match
  their row exactly; a failed stream's row has the input buckets its message_start
  announced and an output between the deltas delivered and max_tokens;
- duplicates: a logical call with more than one ledger row; unattributed rows: rows
  whose request id no attempt saw;
- tracebacks in the gateway's log;
- recovery: from the replica kill to its /readyz answering again, to the gateway
  counting it live again, and to the first call it served; from the NATS kill to
  the gateway reconnecting and to heartbeats of every replica flowing again.

It prints a table and writes the figures as JSON. Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
from rich.console import Console
from rich.table import Table

from cachepoint.bench.usage_ledger import usage_rows
from cachepoint.embedded.demo_session import (
    MAX_TOKENS,
    MODEL,
    SCOPE_BETA,
    TOOLS,
    assistant_turn,
    next_request,
    system_blocks,
)
from cachepoint.embedded.stack import Child, Stack, free_port
from cachepoint.embedded.supervise import Backoff
from cachepoint.events import schema

# Anthropic's error types (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "timeout_error",
        "overloaded_error",
    }
)
BUCKETS = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output")
TURNS_PER_SESSION = 12  # then the session starts over, as a new conversation


@dataclass(slots=True)
class ChaosConfig:
    sessions: int = 16  # concurrent agent sessions
    duration_s: float = 60.0  # no new call starts after this
    replicas: int = 2  # replicas in the stack
    call_timeout_s: float = 60.0  # wall-clock limit of one logical call, retries included
    max_retries: int = 2  # the SDK's automatic retries (its default)
    kill_replica_at: float = 0.25  # share of duration_s
    kill_nats_at: float = 0.60  # share of duration_s
    recovery_wait_s: float = 90.0  # how long past the traffic to wait for recoveries
    tracing: bool = True  # as `cachepoint up` runs
    state_dir: Path | None = None  # default: a fresh temporary folder


@dataclass(slots=True)
class Call:
    """One logical call (SDK retries included) as the client saw it."""

    call_id: str  # also its idempotency-key
    session: int  # which session
    turn: int  # turn within the conversation
    stream: bool  # streamed or not
    t_start: float  # monotonic
    t_end: float = 0.0  # monotonic; 0 while running
    outcome: str = "running"  # "ok", "hang", an Anthropic error type, or "unclean:<what>"
    clean: bool = True  # a failure in Anthropic's shape (or no failure)
    status: int | None = None  # HTTP status of the failure, when there was one
    detail: str = ""  # the error's message
    request_id: str = ""  # of the final attempt, when known
    replica: str = ""  # the cachepoint-replica header
    usage: dict[str, int] | None = None  # five buckets, when the client knows them
    complete: bool = False  # usage is final (ok calls); else only input buckets are known
    deltas: int = 0  # text deltas received (streams)

    @property
    def latency_s(self) -> float:
        return self.t_end - self.t_start


@dataclass(slots=True)
class Recovery:
    """Seconds from a kill to each sign of recovery (None: not seen)."""

    replica_respawned_s: float | None = None  # the supervisor started it again
    replica_ready_s: float | None = None  # its /readyz answered 200
    gateway_live_s: float | None = None  # the gateway counts every replica live again
    replica_first_served_s: float | None = None  # a call it served ended ok
    nats_respawned_s: float | None = None  # the supervisor started nats-server again
    gateway_reconnected_s: float | None = None  # the gateway's event plane is connected
    heartbeats_s: float | None = None  # heartbeats of every replica arrived again


@dataclass(slots=True)
class ChaosResult:
    config: dict[str, Any]
    calls: int
    ok: int
    errors_by_type: dict[str, int]
    hangs: int
    unclean: list[dict[str, Any]]
    latency_p50_s: float | None
    latency_p99_s: float | None
    attempts: int  # HTTP attempts, retries included
    attempt_statuses: dict[str, int]  # HTTP status of each attempt (retried ones too)
    client_buckets: dict[str, int]  # sums the client saw (failed streams: deltas as output)
    ledger_buckets: dict[str, int]
    # NOTE: a failed stream's client knows its deltas, not its tokens: one delta may
    # carry several tokens (text that only completes a character later), so its row
    # is checked to lie between the deltas and max_tokens, not to equal them.
    # failed streams: count, deltas seen, tokens billed; ok streams: deltas, tokens
    failed_stream_output: dict[str, int]
    usage_mismatches: list[dict[str, Any]]  # rows that differ from what the client saw
    billed_failures: list[str]  # request ids billed although the client got an error first
    duplicates: list[str]  # logical calls with more than one ledger row
    unattributed_rows: list[str]  # ledger request ids no attempt saw
    ledger_rows: int
    gateway_tracebacks: int
    replica_tracebacks: int
    supervisor_events: list[dict[str, Any]]
    recovery: dict[str, float | None]
    kills: dict[str, float]  # seconds from the start of traffic
    wall_s: float
    state_dir: str
    failures: list[str] = field(default_factory=list)  # the checks that did not hold

    @property
    def passed(self) -> bool:
        return not self.failures


# ------------------------------------------------------------------ the client


def _error_type(exc: anthropic.APIStatusError) -> tuple[str, str]:
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("type", "")), str(err.get("message", ""))
    return "", str(exc)


def _classify(call: Call, exc: BaseException) -> None:
    if isinstance(exc, anthropic.APITimeoutError | asyncio.TimeoutError | TimeoutError):
        call.outcome, call.clean, call.detail = "hang", False, "no answer within the limit"
        return
    if isinstance(exc, anthropic.APIStatusError):
        kind, message = _error_type(exc)
        call.status = exc.status_code
        call.request_id = call.request_id or (exc.request_id or "")
        call.detail = message[:300]
        sse = exc.status_code == 200  # an SSE error event inside a 200 stream
        internal = exc.status_code == 500 and message.strip().lower() == "internal error"
        if kind in ANTHROPIC_ERROR_TYPES and not internal:
            call.outcome = f"sse:{kind}" if sse else kind
            return
        call.outcome, call.clean = f"unclean:{kind or 'unshaped'}:{exc.status_code}", False
        return
    if isinstance(exc, anthropic.APIConnectionError):
        cause = exc.__cause__ or exc
        call.outcome, call.clean = f"unclean:connection:{type(cause).__name__}", False
        call.detail = str(cause)[:300]
        return
    call.outcome, call.clean = f"unclean:{type(exc).__name__}", False
    call.detail = str(exc)[:300]


def _usage_of(u: Any, output: int | None) -> dict[str, int]:
    cc = getattr(u, "cache_creation", None)
    w5 = cc.ephemeral_5m_input_tokens if cc else 0
    w1 = cc.ephemeral_1h_input_tokens if cc else 0
    return {
        "input": u.input_tokens or 0,
        "cache_read": u.cache_read_input_tokens or 0,
        "cache_write_5m": w5 or 0,
        "cache_write_1h": w1 or 0,
        "output": u.output_tokens if output is None else output,
    }


async def _one_call(
    client: anthropic.AsyncAnthropic,
    call: Call,
    system: list[dict[str, Any]],
    messages: list[dict[str, Any]],
) -> str:
    """Run one call; returns the reply's text (empty on failure)."""
    headers = {"anthropic-beta": SCOPE_BETA, "idempotency-key": call.call_id}
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "tools": TOOLS,
        "system": system,
        "messages": messages,
        "extra_headers": headers,
    }
    if not call.stream:
        raw = await client.messages.with_raw_response.create(**kw)
        call.request_id = raw.headers.get("request-id", "")
        call.replica = raw.headers.get("cachepoint-replica", "")
        msg = await raw.parse()
        call.usage, call.complete = _usage_of(msg.usage, None), True
        return "".join(getattr(b, "text", "") for b in msg.content)
    stream = await client.messages.create(**kw, stream=True)
    call.request_id = stream.response.headers.get("request-id", "")
    call.replica = stream.response.headers.get("cachepoint-replica", "")
    text: list[str] = []
    stopped = False
    async with stream:
        async for ev in stream:
            if ev.type == "message_start":
                call.usage = _usage_of(ev.message.usage, 0)
            elif ev.type == "content_block_delta":
                call.deltas += 1
                text.append(getattr(ev.delta, "text", ""))
            elif ev.type == "message_delta" and call.usage is not None:
                call.usage["output"] = ev.usage.output_tokens
            elif ev.type == "message_stop":
                stopped = True
    if not stopped or call.usage is None:
        raise RuntimeError("stream ended without message_stop or error event")
    call.complete = True
    return "".join(text)


async def _session(
    k: int,
    client: anthropic.AsyncAnthropic,
    cfg: ChaosConfig,
    t_stop: float,
    calls: list[Call],
) -> None:
    stream = k % 2 == 0
    while time.monotonic() < t_stop:
        system = system_blocks()
        system[1] = {"type": "text", "text": f"{system[1]['text']} Session {k}-{uuid.uuid4()}."}
        messages: list[dict[str, Any]] = []
        tool_id: str | None = None
        for i in range(1, TURNS_PER_SESSION + 1):
            if time.monotonic() >= t_stop:
                return
            next_request(messages, i, tool_id)
            call = Call(uuid.uuid4().hex, k, i, stream, time.monotonic())
            calls.append(call)
            try:
                text = await asyncio.wait_for(
                    _one_call(client, call, system, messages), cfg.call_timeout_s
                )
                call.outcome = "ok"
            except Exception as exc:
                _classify(call, exc)
                text = ""
            finally:
                call.t_end = time.monotonic()
            if call.outcome != "ok":
                break  # as an agent would: start a fresh conversation
            reply, tool_id = assistant_turn(i, text)
            messages.append(reply)


# ------------------------------------------------------------------ the faults


async def _quiet(_exc: Exception) -> None:
    return None


async def _quiet_event() -> None:
    return None


class Watch:
    """Polls the stack after each kill for the recovery signs."""

    def __init__(self, stack: Stack, http: httpx.AsyncClient) -> None:
        self.stack = stack
        self.http = http
        self.rec = Recovery()
        self.heartbeats: dict[str, float] = {}  # replica -> monotonic time of the last one

    def child(self, name: str) -> Child:
        return next(c for c in self.stack.children if c.name == name)

    async def _ok(self, url: str) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await self.http.get(url, timeout=1)).status_code == 200
        return False

    async def _gateway(self) -> dict[str, Any]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return dict((await self.http.get(f"{self.stack.base_url}/readyz", timeout=1)).json())
        return {}

    async def replica_kill(
        self, name: str, deadline: float, calls: list[Call], wait_s: float = 5.0
    ) -> float:
        child = self.child(name)
        old = child.pid
        # NOTE: kill it while it serves a stream, when that comes within wait_s: a
        # mid-stream death is the hard case for the client and for billing.
        until = time.monotonic() + wait_s
        while time.monotonic() < until and not any(
            c.stream and c.replica == name and not c.t_end for c in calls
        ):
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            if self.rec.replica_respawned_s is None and child.pid != old:
                self.rec.replica_respawned_s = now
            if (
                self.rec.replica_respawned_s is not None
                and self.rec.replica_ready_s is None
                and await self._ok(f"{child.url}/readyz")
            ):
                self.rec.replica_ready_s = time.monotonic() - t0
            if self.rec.replica_ready_s is not None:
                body = await self._gateway()
                if body.get("replicas_live", 0) >= self.stack.replicas:
                    self.rec.gateway_live_s = time.monotonic() - t0
                    break
            await asyncio.sleep(0.1)
        return t0

    async def nats_kill(self, deadline: float) -> float:
        child = self.child("nats")
        old = child.pid
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            if self.rec.nats_respawned_s is None and child.pid != old:
                self.rec.nats_respawned_s = now
            if self.rec.nats_respawned_s is not None and self.rec.gateway_reconnected_s is None:
                body = await self._gateway()
                # NOTE: "connected" is only trusted after the respawn: before it, the
                # gateway may not have noticed the kill yet.
                if body.get("event_plane") == "connected":
                    self.rec.gateway_reconnected_s = time.monotonic() - t0
            names = [c.name for c in self.stack.children if c.name.startswith("replica-")]
            if self.rec.heartbeats_s is None and all(
                self.heartbeats.get(n, 0.0) > t0 + (self.rec.nats_respawned_s or 1e9) for n in names
            ):
                self.rec.heartbeats_s = max(self.heartbeats[n] for n in names) - t0
            if self.rec.gateway_reconnected_s is not None and self.rec.heartbeats_s is not None:
                break
            await asyncio.sleep(0.1)
        return t0

    async def listen_heartbeats(self) -> Any:
        """Subscribe to heartbeats with the gateway's NATS credentials, if any."""
        import nats

        env = self.child("gateway").env
        user = env.get("CACHEPOINT_GATEWAY_NATS_USER") or env.get("CACHEPOINT_NATS_USER")
        password = env.get("CACHEPOINT_GATEWAY_NATS_PASSWORD") or env.get(
            "CACHEPOINT_NATS_PASSWORD"
        )

        async def on_hb(msg: Any) -> None:
            with contextlib.suppress(ValueError):
                hb = schema.decode(msg.data, schema.Heartbeat)
                self.heartbeats[hb.name] = time.monotonic()

        opts: dict[str, Any] = {
            "servers": [self.stack.nats_url],
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.1,
            "allow_reconnect": True,
            # NOTE: the server is killed on purpose; its refusals are expected noise.
            "error_cb": _quiet,
            "disconnected_cb": _quiet_event,
        }
        if user:
            opts.update(user=user, password=password)
        nc = await nats.connect(**opts)
        await nc.subscribe("cachepoint.replica.heartbeat", cb=on_hb)
        await nc.subscribe("cachepoint.replica.heartbeat.*", cb=on_hb)
        return nc


# ------------------------------------------------------------------ the ledger


_ledger = usage_rows  # the ledger's rows (bench/usage_ledger.py)


def _tracebacks(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").count("Traceback (most recent call last)")
    return 0


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def _audit(
    calls: list[Call], attempts: dict[str, list[tuple[str, int]]], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    by_rid = {r["request_id"]: r for r in rows}
    rid_to_call = {rid: cid for cid, seen in attempts.items() for rid, _ in seen}
    rows_per_call: dict[str, list[str]] = {}
    unattributed = []
    for rid in by_rid:
        cid = rid_to_call.get(rid)
        if cid is None:
            unattributed.append(rid)
        else:
            rows_per_call.setdefault(cid, []).append(rid)
    duplicates = [cid for cid, rids in rows_per_call.items() if len(rids) > 1]
    mismatches: list[dict[str, Any]] = []
    billed_failures: list[str] = []
    client = dict.fromkeys(BUCKETS, 0)
    failed_streams = {"streams": 0, "deltas": 0, "billed": 0, "ok_deltas": 0, "ok_tokens": 0}
    for c in calls:
        for rid, status in attempts.get(c.call_id, []):
            # An attempt answered with an HTTP error status never delivered usage.
            if status >= 400 and rid in by_rid:
                billed_failures.append(rid)
        if c.usage is None:
            continue
        for b in BUCKETS:
            client[b] += c.usage[b] if (c.complete or b != "output") else c.deltas
        row = by_rid.get(c.request_id)
        if row is None:
            mismatches.append({"call": c.call_id, "request_id": c.request_id, "row": None})
            continue
        if c.complete:
            diff = {b: (c.usage[b], row[b]) for b in BUCKETS if c.usage[b] != row[b]}
            if c.stream:  # the deltas-per-token of streams that ended well, for scale
                failed_streams["ok_deltas"] += c.deltas
                failed_streams["ok_tokens"] += c.usage["output"]
        else:
            failed_streams["streams"] += 1
            failed_streams["deltas"] += c.deltas
            failed_streams["billed"] += row["output"]
            diff = {b: (c.usage[b], row[b]) for b in BUCKETS[:4] if c.usage[b] != row[b]}
            if not c.deltas <= row["output"] <= MAX_TOKENS:
                diff["output"] = (c.deltas, row["output"])
        if diff:
            mismatches.append({"call": c.call_id, "request_id": c.request_id, "diff": diff})
    ledger = {b: sum(r[b] for r in rows) for b in BUCKETS}
    return {
        "client_buckets": client,
        "ledger_buckets": ledger,
        "failed_stream_output": failed_streams,
        "usage_mismatches": mismatches,
        "billed_failures": billed_failures,
        "duplicates": duplicates,
        "unattributed_rows": unattributed,
    }


# ------------------------------------------------------------------ the run


async def _drive(
    stack: Stack, cfg: ChaosConfig
) -> tuple[list[Call], dict[str, list[tuple[str, int]]], Recovery, dict[str, float]]:
    calls: list[Call] = []
    attempts: dict[str, list[tuple[str, int]]] = {}

    async def on_response(resp: Any) -> None:
        cid = resp.request.headers.get("idempotency-key")
        if cid:
            attempts.setdefault(cid, []).append(
                (resp.headers.get("request-id", ""), resp.status_code)
            )

    # NOTE: the SDK's own client class (it may wrap another httpx build); the hook
    # sees every HTTP attempt, retries included.
    async with (
        anthropic.DefaultAsyncHttpxClient(event_hooks={"response": [on_response]}) as sdk_http,
        httpx.AsyncClient() as probe_http,
    ):
        client = anthropic.AsyncAnthropic(
            base_url=stack.base_url,
            api_key=stack.keys["api_key"],
            max_retries=cfg.max_retries,
            timeout=cfg.call_timeout_s,
            http_client=sdk_http,
        )
        watch = Watch(stack, probe_http)
        nc = await watch.listen_heartbeats()
        t0 = time.monotonic()
        t_stop = t0 + cfg.duration_s
        sessions = [
            asyncio.create_task(_session(k, client, cfg, t_stop, calls))
            for k in range(cfg.sessions)
        ]
        await asyncio.sleep(cfg.duration_s * cfg.kill_replica_at)
        deadline = t_stop + cfg.recovery_wait_s
        nats_delay = t0 + cfg.duration_s * cfg.kill_nats_at - time.monotonic()
        replica_task = asyncio.create_task(watch.replica_kill("replica-0", deadline, calls))
        await asyncio.sleep(max(0.0, nats_delay))
        nats_task = asyncio.create_task(watch.nats_kill(deadline))
        t_replica_kill = await replica_task
        t_nats_kill = await nats_task
        await asyncio.gather(*sessions)
        served = [
            c.t_end - t_replica_kill
            for c in calls
            if c.replica == "replica-0" and c.outcome == "ok" and c.t_start > t_replica_kill
        ]
        watch.rec.replica_first_served_s = min(served) if served else None
        with contextlib.suppress(Exception):
            await nc.close()
        kills = {"replica-0": t_replica_kill - t0, "nats": t_nats_kill - t0}
    return calls, attempts, watch.rec, kills


def run_chaos(cfg: ChaosConfig, console: Console | None = None) -> ChaosResult:
    console = console or Console()
    state = cfg.state_dir or Path(tempfile.mkdtemp(prefix="cachepoint-chaos-"))
    stack = Stack(
        state_dir=state,
        replicas=cfg.replicas,
        port=free_port(),
        tracing=cfg.tracing,
        backoff=Backoff(),
        on_event=lambda ev: console.print(f"[yellow]supervisor: {ev.describe()}[/yellow]"),
    )
    with console.status("starting the embedded stack"):
        stack.start()
    t_wall = time.monotonic()
    try:
        console.print(
            f"{cfg.sessions} sessions for {cfg.duration_s:.0f}s against {stack.base_url}; "
            f"state in {state}"
        )
        calls, attempts, rec, kills = asyncio.run(_drive(stack, cfg))
        wall = time.monotonic() - t_wall
    finally:
        stack.stop()
    rows = _ledger(stack.db_url)
    audit = _audit(calls, attempts, rows)
    logs = state / "logs"
    errors: dict[str, int] = {}
    for c in calls:
        if c.outcome != "ok":
            errors[c.outcome] = errors.get(c.outcome, 0) + 1
    lat = sorted(c.latency_s for c in calls if c.outcome == "ok")
    sup_log = logs / "supervisor.log"
    sup = [json.loads(x) for x in sup_log.read_text().splitlines()] if sup_log.exists() else []
    result = ChaosResult(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        calls=len(calls),
        ok=sum(c.outcome == "ok" for c in calls),
        errors_by_type=dict(sorted(errors.items())),
        hangs=sum(c.outcome == "hang" for c in calls),
        unclean=[asdict(c) for c in calls if not c.clean],
        latency_p50_s=_pct(lat, 0.5),
        latency_p99_s=_pct(lat, 0.99),
        attempts=sum(len(v) for v in attempts.values()),
        attempt_statuses=dict(
            sorted(Counter(str(st) for seen in attempts.values() for _, st in seen).items())
        ),
        ledger_rows=len(rows),
        gateway_tracebacks=_tracebacks(logs / "gateway.log"),
        replica_tracebacks=sum(_tracebacks(p) for p in logs.glob("replica-*.log")),
        supervisor_events=sup,
        recovery=asdict(rec),
        kills=kills,
        wall_s=wall,
        state_dir=str(state),
        **audit,
    )
    result.failures = _checks(result, rec)
    return result


def buckets_agree(r: ChaosResult) -> bool:
    """Every bucket's sum is the client's; output counts a failed stream at what it
    was billed (its bounds are checked call by call)."""
    fs = r.failed_stream_output
    client = {**r.client_buckets}
    client["output"] += fs["billed"] - fs["deltas"]
    return client == r.ledger_buckets


def _checks(r: ChaosResult, rec: Recovery) -> list[str]:
    out = []
    if r.hangs:
        out.append(f"{r.hangs} calls hung")
    if r.unclean:
        kinds = sorted({u["outcome"] for u in r.unclean})
        out.append(f"{len(r.unclean)} unclean failures: {', '.join(kinds)}")
    if r.usage_mismatches:
        out.append(f"{len(r.usage_mismatches)} calls billed other than the client saw")
    if not buckets_agree(r):
        out.append(f"bucket sums differ: client {r.client_buckets} ledger {r.ledger_buckets}")
    if r.billed_failures:
        out.append(f"{len(r.billed_failures)} failed attempts were billed")
    if r.duplicates:
        out.append(f"{len(r.duplicates)} logical calls billed more than once")
    if r.unattributed_rows:
        out.append(f"{len(r.unattributed_rows)} ledger rows no attempt saw")
    if r.gateway_tracebacks:
        out.append(f"{r.gateway_tracebacks} tracebacks in gateway.log")
    if rec.replica_ready_s is None or rec.gateway_live_s is None:
        out.append("replica-0 did not come back into routing")
    if rec.heartbeats_s is None or rec.gateway_reconnected_s is None:
        out.append("heartbeats did not flow again after the NATS restart")
    if not r.ok:
        out.append("no call succeeded")
    return out


def _fmt(x: float | None, unit: str = "s") -> str:
    return "—" if x is None else f"{x:.2f} {unit}"


def print_result(r: ChaosResult, console: Console) -> None:
    t = Table(title=f"chaos: {r.config['sessions']} sessions, {r.config['duration_s']:.0f} s")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("logical calls / HTTP attempts", f"{r.calls} / {r.attempts}")
    statuses = ", ".join(f"{k}: {v}" for k, v in r.attempt_statuses.items())
    t.add_row("attempts by HTTP status", statuses)
    t.add_row("ok", str(r.ok))
    for kind, n in r.errors_by_type.items():
        t.add_row(f"  error: {kind}", str(n))
    t.add_row("hangs", str(r.hangs))
    t.add_row("unclean failures", str(len(r.unclean)))
    t.add_row("latency p50 / p99 (ok calls)", f"{_fmt(r.latency_p50_s)} / {_fmt(r.latency_p99_s)}")
    for b in BUCKETS:
        t.add_row(f"tokens {b}: client / ledger", f"{r.client_buckets[b]} / {r.ledger_buckets[b]}")
    fs = r.failed_stream_output
    t.add_row(
        "failed streams: deltas seen / tokens billed",
        f"{fs['streams']}: {fs['deltas']} / {fs['billed']}",
    )
    t.add_row("ok streams: deltas / tokens", f"{fs['ok_deltas']} / {fs['ok_tokens']}")
    t.add_row("ledger rows", str(r.ledger_rows))
    t.add_row("usage mismatches", str(len(r.usage_mismatches)))
    t.add_row("billed failed attempts", str(len(r.billed_failures)))
    t.add_row("duplicate billings", str(len(r.duplicates)))
    t.add_row("unattributed rows", str(len(r.unattributed_rows)))
    t.add_row("gateway / replica tracebacks", f"{r.gateway_tracebacks} / {r.replica_tracebacks}")
    t.add_row(
        "replica-0 killed at / NATS killed at",
        f"{r.kills['replica-0']:.1f} / {r.kills['nats']:.1f} s",
    )
    labels = {
        "replica_respawned_s": "replica: respawned",
        "replica_ready_s": "replica: /readyz 200",
        "gateway_live_s": "replica: gateway counts it live",
        "replica_first_served_s": "replica: first call it served",
        "nats_respawned_s": "NATS: respawned",
        "gateway_reconnected_s": "NATS: gateway reconnected",
        "heartbeats_s": "NATS: every replica's heartbeat again",
    }
    for key, label in labels.items():
        t.add_row(f"recovery, {label}", _fmt(r.recovery[key]))
    console.print(t)
    if r.passed:
        console.print("[bold green]every check held[/bold green]")
    else:
        for f in r.failures:
            console.print(f"[red]FAILED: {f}[/red]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--call-timeout", type=float, default=60.0, help="a hang after this")
    ap.add_argument("--retries", type=int, default=2, help="the SDK's max_retries")
    ap.add_argument("--no-tracing", action="store_true")
    ap.add_argument("--state-dir", type=Path, help="default: a fresh temporary folder")
    ap.add_argument("--json", type=Path, default=Path("chaos_bench.json"))
    a = ap.parse_args()
    console = Console(width=None if Console().is_terminal else 120)
    cfg = ChaosConfig(
        sessions=a.sessions,
        duration_s=a.duration,
        replicas=a.replicas,
        call_timeout_s=a.call_timeout,
        max_retries=a.retries,
        tracing=not a.no_tracing,
        state_dir=a.state_dir,
    )
    r = run_chaos(cfg, console)
    print_result(r, console)
    a.json.write_text(json.dumps({**asdict(r), "passed": r.passed}, indent=2, default=str) + "\n")
    console.print(f"figures in {a.json}")
    return 0 if r.passed else 1


if __name__ == "__main__":
    sys.exit(main())
