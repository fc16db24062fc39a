"""KV tiers on the live embedded stack: a device pool too small for the working set,
without and with a host tier behind it, checked against its live targets.

Run:  .venv/bin/python bench/tier_live_bench.py [--tenants 6] [--sessions 2] [--turns 6]

The same workload runs twice, each time on a fresh stack (nats-server, --replicas
replicas, the gateway; the random "small" model with the byte tokenizer, so one
character is one token and the sizes below are exact):

  (a) device: a --kv-budget device pool per replica and no host tier;
  (b) host:   the same device pool plus a host tier --host-factor times larger.

The workload, through the official anthropic SDK (streaming): every tenant is its own
org with a --system-tokens system prompt marked with cache_control, and runs
--sessions conversations of --turns turns; each turn adds a user message of
--turn-tokens characters (tool output) carrying the breakpoint, and the previous
turn's answer. Turns go in rounds: round r runs turn r of every conversation, session
by session and tenant by tenant, --concurrency at a time, so that between two turns of
one conversation every other conversation is touched once. A conversation's prefix is
thus reused only after the whole working set went by: a device pool smaller than the
working set (with LRU) has lost it by then, the host tier still holds it.

Reported side by side: cached tokens served (the billed cache reads from the usage
the clients got, and the engines' own prefix hits from /v1/stats, promoted tokens
included), TTFT mean/p50/p90 (time to the SSE message_start, which the gateway sends
once prefill is done; over every call, and over the turns after the first), the host
tier's hits, promotions, demotions, evictions and bytes moved, and the seconds the
engines spent copying. The ledger (the gateway's SQLite usage table) is checked
against the usage the clients got: per request, and summed per bucket.

Targets (exit status 1 when one is missed, with the reason): the host tier serves at
least 2x the cached tokens (billed reads, and engine hits); TTFT p90 is lower with it; each run's
ledger equals the clients' usage exactly; the host run promoted blocks; the working
set is larger than the device pool. Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx

from cachepoint.bench.usage_ledger import usage_rows
from cachepoint.embedded.stack import Stack, StackError, free_port
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.settings import parse_bytes

BUCKETS = ("input", "cache_read", "cache_write_5m", "cache_write_1h", "output")
TOPICS = ["kettles", "bicycles", "tax forms", "greenhouses", "violins", "sailboats", "bonsai"]
WORDS = ["alpha", "delta", "gauge", "ledger", "quartz", "rivet", "sprocket", "tundra", "vortex"]


@dataclass(slots=True)
class TierBenchConfig:
    tenants: int = 6  # orgs, each with its own system prompt
    sessions: int = 2  # conversations per tenant
    turns: int = 6  # turns per conversation (rounds)
    system_tokens: int = 1024  # system prompt length (characters = byte tokens)
    turn_tokens: int = 256  # tool output added to the conversation each turn
    max_tokens: int = 8  # output per call
    concurrency: int = 2  # calls in flight at once
    replicas: int = 1  # replicas per stack
    preset: str = "small"  # the replicas' random model
    kv_budget: str = "32MiB"  # device KV pool per replica
    host_factor: float = 4.0  # host tier = this x the device pool (run b)
    min_cacheable_tokens: int = 256  # the gateway's smallest cache entry
    call_timeout_s: float = 300.0  # one call's limit, retries included
    state_dir: Path | None = None  # parent of the two stacks' state; default: a temp folder

    def host_bytes(self) -> int:
        return int(self.host_factor * parse_bytes(self.kv_budget))

    def check(self) -> None:
        """ValueError for a configuration that cannot run (or cannot show anything)."""
        positive = (
            "tenants",
            "sessions",
            "turns",
            "system_tokens",
            "turn_tokens",
            "max_tokens",
            "concurrency",
            "replicas",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.turns < 2:
            raise ValueError("turns must be at least 2: a prefix is only reused from turn 2 on")
        if self.host_factor <= 0:
            raise ValueError(f"host factor must be positive, not {self.host_factor}")
        if self.preset not in ("tiny", "small"):
            raise ValueError(f"preset must be tiny or small, not {self.preset!r}")
        if parse_bytes(self.kv_budget) <= 0:
            raise ValueError(f"kv budget must be positive, not {self.kv_budget!r}")


@dataclass(slots=True)
class Call:
    """One call as its client saw it."""

    tenant: int  # which tenant (org)
    session: int  # which of the tenant's conversations
    turn: int  # 0-based; the round it ran in
    ttft_s: float = 0.0  # from sending to the SSE message_start
    request_id: str = ""  # the response's request-id header
    usage: dict[str, int] | None = None  # the five buckets the client was told
    error: str = ""  # why it failed, when it did


@dataclass(slots=True)
class RunResult:
    label: str  # "device" or "host"
    host_bytes: int  # host tier per replica (0: none)
    calls: int  # calls made
    failed: list[str]  # "tenant/session/turn: error" for each failed call
    prompt_tokens: int  # every call's prompt, summed (as billed)
    billed_read: int  # cache_read_input_tokens the clients were billed
    engine_query_tokens: int  # prompt tokens the engines looked up
    engine_hit_tokens: int  # of those, served from cache (device and promoted)
    promoted_tokens: int  # of the hits, promoted from a lower tier
    device_pool_tokens: int  # device KV pool per replica, in tokens
    working_set_tokens: int  # distinct prompt tokens the workload touched (all replicas)
    ttft_mean_s: float  # every call
    ttft_p50_s: float  # every call
    ttft_p90_s: float  # every call
    warm_ttft_mean_s: float  # calls after each conversation's first turn
    warm_ttft_p90_s: float  # calls after each conversation's first turn
    tiers: dict[str, dict[str, int]]  # per lower tier: counters summed over the replicas
    copied_blocks: int  # blocks the engines copied between tiers
    copy_seconds: float  # seconds the engines spent on those copies
    evictions: int  # device-pool evictions
    retain_refusals: int  # cache writes refused a TTL (retained cap or tenant quota)
    client_buckets: dict[str, int]  # the clients' usage, summed per bucket
    ledger_buckets: dict[str, int]  # the ledger's rows, summed per bucket
    ledger_rows: int  # rows in the ledger's usage table
    usage_mismatches: list[dict[str, Any]]  # calls whose row differs from their usage
    unattributed_rows: list[str]  # ledger request ids no call saw
    wall_s: float  # traffic time (stack start and stop excluded)
    state_dir: str

    @property
    def ledger_ok(self) -> bool:
        return (
            not self.usage_mismatches
            and not self.unattributed_rows
            and self.client_buckets == self.ledger_buckets
            and self.ledger_rows == self.calls - len(self.failed)
        )


# ------------------------------------------------------------------ the workload


def system_prompt(tenant: int, tokens: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    line = f"You are tenant {tenant}'s support agent for {topic}; answer precisely. "
    return (line * (tokens // len(line) + 1))[:tokens]


def tool_output(tenant: int, session: int, turn: int, tokens: int) -> str:
    """Text unique to this turn: no other conversation shares it."""
    head = f"[t{tenant} s{session} turn {turn}] tool output: "
    body = " ".join(
        WORDS[(tenant * 7 + session * 3 + turn + i) % len(WORDS)] for i in range(tokens)
    )
    return (head + body)[:tokens]


def _usage_of(u: Any, output: int) -> dict[str, int]:
    cc = getattr(u, "cache_creation", None)
    return {
        "input": u.input_tokens or 0,
        "cache_read": u.cache_read_input_tokens or 0,
        "cache_write_5m": (cc.ephemeral_5m_input_tokens or 0) if cc else 0,
        "cache_write_1h": (cc.ephemeral_1h_input_tokens or 0) if cc else 0,
        "output": output,
    }


class Conversation:
    """One tenant's session: its messages so far, with the breakpoint on the last."""

    def __init__(self, tenant: int, session: int, cfg: TierBenchConfig) -> None:
        self.tenant = tenant
        self.session = session
        self.cfg = cfg
        self.system = [
            {
                "type": "text",
                "text": system_prompt(tenant, cfg.system_tokens),
                "cache_control": {"type": "ephemeral"},
            }
        ]
        self.messages: list[dict[str, Any]] = []

    def turn(self, client: anthropic.Anthropic, model: str, turn: int) -> Call:
        for m in self.messages:
            for b in m["content"]:
                b.pop("cache_control", None)
        text = tool_output(self.tenant, self.session, turn, self.cfg.turn_tokens)
        block = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        self.messages.append({"role": "user", "content": [block]})
        call = Call(self.tenant, self.session, turn)
        t0 = time.perf_counter()
        try:
            stream = client.messages.create(
                model=model,
                max_tokens=self.cfg.max_tokens,
                system=self.system,  # type: ignore[arg-type]
                messages=self.messages,  # type: ignore[arg-type]
                stream=True,
            )
            call.request_id = stream.response.headers.get("request-id", "")
            usage: dict[str, int] | None = None
            stopped = False
            with stream:
                for ev in stream:
                    if ev.type == "message_start":
                        call.ttft_s = time.perf_counter() - t0
                        usage = _usage_of(ev.message.usage, 0)
                    elif ev.type == "message_delta" and usage is not None:
                        usage["output"] = ev.usage.output_tokens
                    elif ev.type == "message_stop":
                        stopped = True
            if not stopped or usage is None:
                raise RuntimeError("the stream ended without message_stop")
            call.usage = usage
        except Exception as exc:  # a failed call is a finding: reported, not raised
            call.error = f"{type(exc).__name__}: {exc}"[:300]
        # NOTE: a fixed answer, not the sampled one (random weights): the next turn's
        # prefix is this call's prompt, whatever was generated.
        answer = f"answer {turn} for tenant {self.tenant} session {self.session}"
        self.messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        return call


def drive(
    stack: Stack,
    cfg: TierBenchConfig,
    log: Callable[[str], None],
) -> list[Call]:
    """Every round runs one turn of every conversation, --concurrency at a time."""
    engine = make_engine(stack.db_url)
    with make_sessionmaker(engine)() as s:
        keys = [create_key(s, create_org(s, f"tenant-{t}"))[1] for t in range(cfg.tenants)]
        s.commit()
    engine.dispose()
    clients = [
        anthropic.Anthropic(
            base_url=stack.base_url, api_key=k, max_retries=2, timeout=cfg.call_timeout_s
        )
        for k in keys
    ]
    model = stack.served_model()
    # NOTE: session-major order: a tenant's conversations run a whole pass over the
    # tenants apart, so one does not keep the other's system prompt warm for it.
    convs = [Conversation(t, sid, cfg) for sid in range(cfg.sessions) for t in range(cfg.tenants)]
    calls: list[Call] = []
    lock = threading.Lock()
    t_start = time.perf_counter()
    for turn in range(cfg.turns):
        queue = list(convs)

        def worker(turn: int = turn, queue: list[Conversation] = queue) -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    conv = queue.pop(0)
                call = conv.turn(clients[conv.tenant], model, turn)
                with lock:
                    calls.append(call)

        threads = [threading.Thread(target=worker) for _ in range(cfg.concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done = [c for c in calls if c.turn == turn and c.usage is not None]
        read = sum(c.usage["cache_read"] for c in done if c.usage)
        ttft = statistics.mean(c.ttft_s for c in done) if done else 0.0
        log(
            f"  round {turn + 1}/{cfg.turns}: {len(done)}/{len(convs)} ok, "
            f"{read} cached tokens billed, TTFT mean {ttft * 1e3:.0f} ms, "
            f"{time.perf_counter() - t_start:.0f} s"
        )
    for c in clients:
        c.close()
    return calls


# ------------------------------------------------------------------ the ledger


ledger_rows = usage_rows  # the ledger's rows (bench/usage_ledger.py)


def audit(calls: list[Call], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ledger against what the clients were told: call by call, and per bucket."""
    by_rid = {r["request_id"]: r for r in rows}
    seen = {c.request_id for c in calls if c.request_id}
    client = dict.fromkeys(BUCKETS, 0)
    mismatches: list[dict[str, Any]] = []
    for c in calls:
        if c.usage is None:
            continue
        for b in BUCKETS:
            client[b] += c.usage[b]
        row = by_rid.get(c.request_id)
        if row is None:
            mismatches.append({"request_id": c.request_id, "row": None})
            continue
        diff = {b: (c.usage[b], row[b]) for b in BUCKETS if c.usage[b] != row[b]}
        if diff:
            mismatches.append({"request_id": c.request_id, "diff": diff})
    return {
        "client_buckets": client,
        "ledger_buckets": {b: sum(r[b] for r in rows) for b in BUCKETS},
        "ledger_rows": len(rows),
        "usage_mismatches": mismatches,
        "unattributed_rows": [rid for rid in by_rid if rid not in seen],
    }


# ------------------------------------------------------------------ one run


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def replica_stats(stack: Stack) -> list[dict[str, Any]]:
    """Every replica's /v1/stats (with the stack's internal token)."""
    token = stack.credentials.internal_token if stack.credentials else ""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    out = []
    for child in stack.children:
        if child.name.startswith("replica-"):
            resp = httpx.get(f"{child.url}/v1/stats", headers=headers, timeout=10)
            resp.raise_for_status()
            out.append(resp.json())
    return out


def _tiers(stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    tiers: dict[str, dict[str, int]] = {}
    for st in stats:
        for t in st.get("tiers", []):
            slots = t["slots"]
            block_bytes = t["bytes"] // slots if slots else 0
            agg = tiers.setdefault(t["tier"], dict.fromkeys(_TIER_KEYS, 0))
            for k in ("slots", "bytes", "used", "retained"):
                agg[k] += t[k]
            for k in ("hit_blocks", "promoted_blocks", "demoted_blocks", "evicted_blocks"):
                agg[k] += t[k]
            agg["dropped_blocks"] += t["dropped_blocks"]
            agg["failed_copies"] += t["failed_copies"]
            agg["promoted_bytes"] += t["promoted_blocks"] * block_bytes
            agg["demoted_bytes"] += t["demoted_blocks"] * block_bytes
            agg["promoted_tokens"] += t["promoted_blocks"] * st["block_size"]
    return tiers


_TIER_KEYS = (
    "slots",
    "bytes",
    "used",
    "retained",
    "hit_blocks",
    "promoted_blocks",
    "demoted_blocks",
    "evicted_blocks",
    "dropped_blocks",
    "failed_copies",
    "promoted_bytes",
    "demoted_bytes",
    "promoted_tokens",
)


def working_set(calls: list[Call], cfg: TierBenchConfig) -> int:
    """Distinct prompt tokens: each conversation's longest prompt, less the system
    prompt its tenant's other conversations share."""
    longest: dict[tuple[int, int], int] = {}
    for c in calls:
        if c.usage is not None:
            prompt = sum(c.usage[b] for b in BUCKETS[:4])
            key = (c.tenant, c.session)
            longest[key] = max(longest.get(key, 0), prompt)
    shared = cfg.tenants * (cfg.sessions - 1) * cfg.system_tokens
    return max(0, sum(longest.values()) - shared)


def run_once(
    cfg: TierBenchConfig, label: str, host_bytes: int, log: Callable[[str], None]
) -> RunResult:
    parent = cfg.state_dir or Path(tempfile.mkdtemp(prefix="cachepoint-tier-bench-"))
    state = parent / label
    stack = Stack(
        state_dir=state,
        replicas=cfg.replicas,
        port=free_port(),
        model_preset=cfg.preset,
        tokenizer="bytes",
        min_cacheable_tokens=cfg.min_cacheable_tokens,
        kv_budget=cfg.kv_budget,
        kv_host_bytes=str(host_bytes) if host_bytes else None,
        tracing=False,
    )
    log(
        f"[{label}] starting a stack: {cfg.replicas} replica(s), {cfg.kv_budget} device KV"
        + (f" + {host_bytes / 2**20:.0f} MiB host tier" if host_bytes else ", no host tier")
    )
    stack.start()
    try:
        t0 = time.perf_counter()
        calls = drive(stack, cfg, log)
        wall = time.perf_counter() - t0
        stats = replica_stats(stack)
    finally:
        stack.stop()
    rows = ledger_rows(stack.db_url)
    ok = [c for c in calls if c.usage is not None]
    ttft = [c.ttft_s for c in ok]
    warm = [c.ttft_s for c in ok if c.turn > 0]
    tiers = _tiers(stats)
    return RunResult(
        label=label,
        host_bytes=host_bytes,
        calls=len(calls),
        failed=[f"{c.tenant}/{c.session}/{c.turn}: {c.error}" for c in calls if c.error],
        prompt_tokens=sum(c.usage[b] for c in ok if c.usage for b in BUCKETS[:4]),
        billed_read=sum(c.usage["cache_read"] for c in ok if c.usage),
        engine_query_tokens=sum(s["query_tokens"] for s in stats),
        engine_hit_tokens=sum(s["hit_tokens"] for s in stats),
        promoted_tokens=sum(t["promoted_tokens"] for t in tiers.values()),
        device_pool_tokens=min(s["blocks"]["total"] * s["block_size"] for s in stats),
        working_set_tokens=working_set(calls, cfg),
        ttft_mean_s=statistics.mean(ttft) if ttft else 0.0,
        ttft_p50_s=_pct(ttft, 0.5),
        ttft_p90_s=_pct(ttft, 0.9),
        warm_ttft_mean_s=statistics.mean(warm) if warm else 0.0,
        warm_ttft_p90_s=_pct(warm, 0.9),
        tiers=tiers,
        copied_blocks=sum(s.get("copied_blocks", 0) for s in stats),
        copy_seconds=sum(s.get("copy_seconds", 0.0) for s in stats),
        evictions=sum(s["evictions"] for s in stats),
        retain_refusals=sum(s["retain_refusals"] for s in stats),
        wall_s=wall,
        state_dir=str(state),
        **audit(calls, rows),
    )


# ------------------------------------------------------------------ comparison


@dataclass(slots=True)
class Comparison:
    device: RunResult  # (a) no host tier
    host: RunResult  # (b) with the host tier
    read_ratio: float  # billed cache reads, host over device
    hit_ratio: float  # engine hits, host over device
    failures: list[str] = field(default_factory=list)  # targets missed

    @property
    def passed(self) -> bool:
        return not self.failures


def _ratio(a: float, b: float) -> float:
    return a / b if b else (float("inf") if a else 1.0)


def compare(device: RunResult, host: RunResult) -> Comparison:
    cmp = Comparison(
        device,
        host,
        _ratio(host.billed_read, device.billed_read),
        _ratio(host.engine_hit_tokens, device.engine_hit_tokens),
    )
    out = cmp.failures
    for r in (device, host):
        if r.failed:
            out.append(f"[{r.label}] {len(r.failed)} calls failed, first: {r.failed[0]}")
        if not r.ledger_ok:
            out.append(
                f"[{r.label}] the ledger differs from the clients' usage: "
                f"client {r.client_buckets}, ledger {r.ledger_buckets}, "
                f"{len(r.usage_mismatches)} calls mismatched, "
                f"{len(r.unattributed_rows)} rows no call saw, {r.ledger_rows} rows"
            )
    if device.working_set_tokens <= device.device_pool_tokens:
        out.append(
            f"the working set ({device.working_set_tokens} tokens) fits the device pool "
            f"({device.device_pool_tokens} tokens): raise --tenants/--turns or lower --kv-budget"
        )
    if device.tiers:
        out.append(f"[device] has lower tiers {sorted(device.tiers)}: it should have none")
    if host.tiers.get("host", {}).get("promoted_blocks", 0) <= 0:
        out.append("[host] promoted no block from the host tier")
    if cmp.read_ratio < 2.0:
        # NOTE: a read is billed only on a live cache entry, and an entry is written only
        # if its blocks can be retained for its TTL: writes refused a TTL leave hits the
        # engine serves (from any tier) unbilled as reads. The refusals say how many.
        out.append(
            f"cached tokens served (billed reads) grew {cmp.read_ratio:.2f}x with the host "
            f"tier ({device.billed_read} -> {host.billed_read}); target >= 2x "
            f"(engine hits grew {cmp.hit_ratio:.2f}x; cache writes refused a TTL: "
            f"{device.retain_refusals} without the host tier, {host.retain_refusals} with it)"
        )
    if cmp.hit_ratio < 2.0:
        out.append(
            f"cached tokens served (engine hits) grew {cmp.hit_ratio:.2f}x with the host "
            f"tier ({device.engine_hit_tokens} -> {host.engine_hit_tokens}); target >= 2x"
        )
    if not host.ttft_p90_s < device.ttft_p90_s:
        out.append(
            f"TTFT p90 is not lower with the host tier: {host.ttft_p90_s * 1e3:.0f} ms vs "
            f"{device.ttft_p90_s * 1e3:.0f} ms without"
        )
    return cmp


def run_bench(cfg: TierBenchConfig, log: Callable[[str], None] = print) -> Comparison:
    cfg.check()
    device = run_once(cfg, "device", 0, log)
    host = run_once(cfg, "host", cfg.host_bytes(), log)
    return compare(device, host)


def report(cmp: Comparison, cfg: TierBenchConfig) -> str:
    d, h = cmp.device, cmp.host
    dt, ht = d.tiers.get("host", {}), h.tiers.get("host", {})
    mib = 2**20

    def row(name: str, a: str, b: str) -> str:
        return f"{name:42}{a:>16}{b:>16}"

    def ms(x: float) -> str:
        return f"{x * 1e3:.0f}"

    lines = [
        f"{cfg.tenants} tenants x {cfg.sessions} sessions x {cfg.turns} turns, "
        f"{cfg.system_tokens}-token system prompts, {cfg.turn_tokens} tokens added a turn, "
        f"concurrency {cfg.concurrency}, {cfg.replicas} replica(s), {cfg.preset} model; "
        f"device pool {cfg.kv_budget} ({d.device_pool_tokens} tokens) per replica; "
        f"working set ~{d.working_set_tokens} tokens "
        f"({d.working_set_tokens / max(d.device_pool_tokens * cfg.replicas, 1):.1f}x the "
        f"device pools)",
        row("", "(a) device only", "(b) + host tier"),
        row("host tier per replica (MiB)", "0", f"{h.host_bytes / mib:.0f}"),
        row("calls (failed)", f"{d.calls} ({len(d.failed)})", f"{h.calls} ({len(h.failed)})"),
        row("prompt tokens", str(d.prompt_tokens), str(h.prompt_tokens)),
        row("cached tokens billed (cache reads)", str(d.billed_read), str(h.billed_read)),
        row(
            "  share of prompt",
            f"{d.billed_read / max(d.prompt_tokens, 1):.1%}",
            f"{h.billed_read / max(h.prompt_tokens, 1):.1%}",
        ),
        row(
            "engine hit tokens (device + promoted)",
            str(d.engine_hit_tokens),
            str(h.engine_hit_tokens),
        ),
        row("  of which promoted", str(d.promoted_tokens), str(h.promoted_tokens)),
        row("device evictions (blocks)", str(d.evictions), str(h.evictions)),
        row("retention refusals (cache writes)", str(d.retain_refusals), str(h.retain_refusals)),
        row(
            "TTFT mean / p50 / p90 (ms)",
            f"{ms(d.ttft_mean_s)}/{ms(d.ttft_p50_s)}/{ms(d.ttft_p90_s)}",
            f"{ms(h.ttft_mean_s)}/{ms(h.ttft_p50_s)}/{ms(h.ttft_p90_s)}",
        ),
        row(
            "TTFT after turn 1: mean / p90 (ms)",
            f"{ms(d.warm_ttft_mean_s)}/{ms(d.warm_ttft_p90_s)}",
            f"{ms(h.warm_ttft_mean_s)}/{ms(h.warm_ttft_p90_s)}",
        ),
        row(
            "host tier hits / promoted (blocks)",
            f"{dt.get('hit_blocks', 0)}/{dt.get('promoted_blocks', 0)}",
            f"{ht.get('hit_blocks', 0)}/{ht.get('promoted_blocks', 0)}",
        ),
        row(
            "host tier demoted / evicted (blocks)",
            f"{dt.get('demoted_blocks', 0)}/{dt.get('evicted_blocks', 0)}",
            f"{ht.get('demoted_blocks', 0)}/{ht.get('evicted_blocks', 0)}",
        ),
        row(
            "host tier MiB promoted / demoted",
            f"{dt.get('promoted_bytes', 0) / mib:.1f}/{dt.get('demoted_bytes', 0) / mib:.1f}",
            f"{ht.get('promoted_bytes', 0) / mib:.1f}/{ht.get('demoted_bytes', 0) / mib:.1f}",
        ),
        row(
            "copied blocks / copy seconds",
            f"{d.copied_blocks}/{d.copy_seconds:.3f}",
            f"{h.copied_blocks}/{h.copy_seconds:.3f}",
        ),
        row(
            "ledger == client usage (per bucket)",
            "yes" if d.ledger_ok else "NO",
            "yes" if h.ledger_ok else "NO",
        ),
        row("traffic wall (s)", f"{d.wall_s:.0f}", f"{h.wall_s:.0f}"),
        f"cached tokens served: {cmp.read_ratio:.2f}x billed "
        f"({'met' if cmp.read_ratio >= 2 else 'MISSED'}), {cmp.hit_ratio:.2f}x engine hits "
        f"({'met' if cmp.hit_ratio >= 2 else 'MISSED'}; target >= 2x); TTFT p90 "
        f"{'lower' if h.ttft_p90_s < d.ttft_p90_s else 'NOT lower'} with the host tier",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = TierBenchConfig()
    ap.add_argument(
        "--tenants", type=int, default=d.tenants, help="orgs, each with its own system prompt"
    )
    ap.add_argument("--sessions", type=int, default=d.sessions, help="conversations per tenant")
    ap.add_argument("--turns", type=int, default=d.turns, help="turns per conversation (rounds)")
    ap.add_argument(
        "--system-tokens", type=int, default=d.system_tokens, help="system prompt length in tokens"
    )
    ap.add_argument(
        "--turn-tokens",
        type=int,
        default=d.turn_tokens,
        help="tool output added per turn, in tokens",
    )
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per call")
    ap.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="calls in flight at once"
    )
    ap.add_argument("--replicas", type=int, default=d.replicas, help="replicas per stack")
    ap.add_argument(
        "--preset", default=d.preset, choices=["tiny", "small"], help="the replicas' random model"
    )
    ap.add_argument(
        "--kv-budget", default=d.kv_budget, help="device KV pool per replica, e.g. 32MiB"
    )
    ap.add_argument(
        "--host-factor",
        type=float,
        default=d.host_factor,
        help="host tier (run b) = this x --kv-budget",
    )
    ap.add_argument(
        "--min-cacheable-tokens",
        type=int,
        default=d.min_cacheable_tokens,
        help="the gateway's smallest cache entry",
    )
    ap.add_argument(
        "--state-dir",
        type=Path,
        help="where the two stacks keep their state (default: a temp folder)",
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    cfg = TierBenchConfig(
        tenants=a.tenants,
        sessions=a.sessions,
        turns=a.turns,
        system_tokens=a.system_tokens,
        turn_tokens=a.turn_tokens,
        max_tokens=a.max_tokens,
        concurrency=a.concurrency,
        replicas=a.replicas,
        preset=a.preset,
        kv_budget=a.kv_budget,
        host_factor=a.host_factor,
        min_cacheable_tokens=a.min_cacheable_tokens,
        state_dir=a.state_dir,
    )
    try:
        cfg.check()
    except ValueError as exc:
        ap.error(str(exc))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        cmp = run_bench(cfg, log)
    except StackError as exc:
        print(f"cannot run the bench: {exc}", file=sys.stderr)
        return 1
    print(report(cmp, cfg))
    if a.json:
        body = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
            "device": asdict(cmp.device),
            "host": asdict(cmp.host),
            "read_ratio": cmp.read_ratio,
            "hit_ratio": cmp.hit_ratio,
            "failures": cmp.failures,
            "passed": cmp.passed,
        }
        a.json.write_text(json.dumps(body, indent=2, default=str) + "\n")
        print(f"figures in {a.json}")
    if cmp.passed:
        print("every target met")
        return 0
    for f in cmp.failures:
        print(f"TARGET MISSED: {f}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
