"""The engine's targets, side by side in one run on this machine.

1. Decode throughput at batch 1, 8 and 32 over an 8,192-token prefix that every lane
   shares (``prefill_bench.py``'s 25.6M-parameter model): batch 8 must reach 4x batch 1.
2. The tiny 2-layer model: a 6,000-token prompt whose first 5,664 tokens are cached
   and 336 are new. The engine's prefill step, and the replica scheduler's ``prefill``
   span (admission to commit, read from an in-memory OpenTelemetry exporter), must
   take at most 10 ms; a decode step at batch 1, at most 1 ms (engine step, and the
   scheduler's ``decode`` span divided by its tokens).
3. A 131,072-token prompt prefilled on the tiny model in 8,192-token chunks, in a fresh
   process: peak RSS growth must be linear in the prompt (no ``[n, N]`` tensor); it
   is reported next to the pool's own size and the ``N x N`` mask it avoids.

    .venv/bin/python bench/engine_bench.py              # everything (a few minutes)
    .venv/bin/python bench/engine_bench.py --skip-128k  # parts 1 and 2 only

Timings are the best of ``--repeats`` rounds; other processes on the same cores stall
torch's threads, so the bench reports how much of the CPUs others used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cachepoint.bench.prefill_bench import OtherLoad  # the machine-load probe
from cachepoint.engine import DecodeRequest, Engine, EngineConfig, ModelConfig, PrefillRequest
from cachepoint.engine.generate import BlockAllocator
from cachepoint.engine.tokenizer import BYTE_VOCAB_SIZE
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.loop import TorchCore, engine_executor
from cachepoint.replica.settings import ReplicaSettings

BATCHES = (1, 8, 32)


def best(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in seconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def decode_scaling(args: argparse.Namespace) -> dict[int, float]:
    """Tokens/s at each batch width over one shared 8k prefix."""
    n, bs, steps = args.context, 16, args.decode_steps
    mc = ModelConfig(
        num_layers=4,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        vocab_size=BYTE_VOCAB_SIZE,
        max_position_embeddings=n + steps + 1,
    )
    lane_blocks = math.ceil((steps + 1) / bs) + 1
    blocks = math.ceil(n / bs) + max(BATCHES) * lane_blocks + 8
    engine = Engine(
        mc,
        EngineConfig(
            block_size=bs, device="cpu", kv_cache_bytes=blocks * bs * mc.kv_bytes_per_token()
        ),
        seed=0,
    )
    alloc = BlockAllocator(engine.num_blocks)
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(n)]
    prefix = alloc(n // bs)
    engine.prefill([PrefillRequest(prompt, prefix, 0, seq_id=0)])
    rates: dict[int, float] = {}
    for width in BATCHES:
        # Every lane shares the prompt's blocks and writes its own from position n on.
        lanes = [prefix + alloc(lane_blocks) for _ in range(width)]
        ids = list(range(1, width + 1))

        def run(lanes: list[list[int]] = lanes, ids: list[int] = ids) -> None:
            tokens = [prompt[-1]] * len(lanes)
            for step in range(steps):
                reqs = [
                    DecodeRequest(tokens[i], n + step, lanes[i], seq_id=ids[i])
                    for i in range(len(lanes))
                ]
                tokens = engine.decode(reqs).argmax(-1).tolist()

        run()  # warm-up: the kernels' first calls at this width
        rates[width] = width * steps / best(run, args.repeats)
        for lane, seq in zip(lanes, ids, strict=True):
            engine.forget(seq)
            alloc.release(lane[len(prefix) :])
    return rates


def tiny_engine_steps(args: argparse.Namespace) -> tuple[float, float]:
    """The tiny model's cached-prompt prefill and batch-1 decode step, engine only."""
    mc = ModelConfig.tiny(max_position_embeddings=2**14)
    engine = Engine(mc, EngineConfig(kv_cache_bytes=64 << 20), seed=0)
    alloc = BlockAllocator(engine.num_blocks)
    total, cached = args.tiny_prompt, args.tiny_cached
    prompt = [i % 250 + 1 for i in range(total)]
    table = alloc(math.ceil((total + 64) / 16))
    engine.prefill([PrefillRequest(prompt, table, 0)])
    prefill = best(lambda: engine.prefill([PrefillRequest(prompt, table, cached, 1)]), 20)
    decode = best(lambda: engine.decode([DecodeRequest(5, total, table, 1)]), 200)
    return prefill, decode


async def _tiny_spans(
    args: argparse.Namespace, thread: ThreadPoolExecutor
) -> tuple[float, float, int]:
    mc = ModelConfig.tiny(max_position_embeddings=2**14)
    # NOTE: built on the thread that steps it, as the replica's app does (engine_executor).
    engine = await asyncio.get_running_loop().run_in_executor(
        thread, lambda: Engine(mc, EngineConfig(kv_cache_bytes=64 << 20), seed=0)
    )
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sched = TorchCore(
        engine, ReplicaSettings(name="bench", random_turn_tokens=0), engine_thread=thread
    )
    sched.tracer = provider.get_tracer("engine_bench")
    sched.start()
    total, cached = args.tiny_prompt, args.tiny_cached
    rng = random.Random(1)
    base = [rng.randrange(1, 256) for _ in range(total)]
    prefill_s: list[float] = []
    decode_s: list[float] = []
    tokens = 64
    try:
        first = sched.submit(GenerateRequest(token_ids=base, max_tokens=1))
        await first.done
        for r in range(args.repeats):
            # Same cached prefix, 336 new tokens that differ each round (no full hit).
            tail = [rng.randrange(1, 256) for _ in range(total - cached)]
            exporter.clear()
            seq = sched.submit(
                GenerateRequest(
                    token_ids=base[:cached] + tail, max_tokens=tokens, ignore_eos=True, seed=r
                )
            )
            await seq.done
            assert seq.cache is not None and seq.cache.engine_hit_tokens == cached
            spans = {s.name: s for s in exporter.get_finished_spans()}
            for name, out in (("prefill", prefill_s), ("decode", decode_s)):
                span = spans[name]
                assert span.end_time is not None and span.start_time is not None
                out.append((span.end_time - span.start_time) / 1e9)
    finally:
        await sched.stop()
    # NOTE: the decode span runs from the first token to the last: tokens - 1 steps.
    return min(prefill_s), min(decode_s) / (tokens - 1), tokens


_PROBE = textwrap.dedent(
    """
    import json, math, sys, time
    import torch
    from cachepoint.engine import Engine, EngineConfig, ModelConfig, PrefillRequest

    total, chunk = int(sys.argv[1]), int(sys.argv[2])
    bs = 16
    mc = ModelConfig.tiny(max_position_embeddings=total)
    engine = Engine(mc, EngineConfig(block_size=bs, device="cpu",
        kv_cache_bytes=(total // bs + 8) * bs * mc.kv_bytes_per_token()), seed=0)
    table = list(range(math.ceil(total / bs)))
    prompt = [i % 250 + 1 for i in range(total)]
    engine.prefill([PrefillRequest(prompt[:2 * chunk], table, chunk, seq_id=9)])  # warm-up
    engine.forget(9)
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    # NOTE: the peak is reset (clear_refs 5) so that start-up's transient peak, e.g.
    # while the weights were built, cannot hide the prefill's own.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    t = time.perf_counter()
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        engine.prefill([PrefillRequest(prompt[:end], table, start, seq_id=1)])
    seconds = time.perf_counter() - t
    after = status("VmHWM:")
    print(json.dumps({"growth_bytes": after - before, "seconds": seconds,
        "pool_bytes": engine.kv_pool_bytes}))
    """
)


def long_prefill(total: int, chunk: int) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(total), str(chunk)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--context", type=int, default=8192, help="shared prefix for part 1 (8192)")
    ap.add_argument("--decode-steps", type=int, default=16, help="decode steps per round (16)")
    ap.add_argument("--tiny-prompt", type=int, default=6000, help="tiny prompt tokens (6000)")
    ap.add_argument("--tiny-cached", type=int, default=5664, help="of which cached (5664)")
    ap.add_argument("--long", type=int, default=131072, help="part 3's prompt (131072)")
    ap.add_argument("--chunk", type=int, default=8192, help="part 3's prefill chunk (8192)")
    ap.add_argument("--skip-128k", action="store_true", help="skip part 3")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, best of (5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    args = ap.parse_args(argv)
    if args.tiny_cached % 16 or not 0 < args.tiny_cached < args.tiny_prompt:
        ap.error("--tiny-cached must be a multiple of 16 below --tiny-prompt")
    if args.threads:
        torch.set_num_threads(args.threads)
    others = OtherLoad()
    print(
        f"engine_bench  torch {torch.__version__}  {platform.machine()}  "
        f"threads={torch.get_num_threads()}  rounds={args.repeats} (best of)",
        flush=True,
    )
    verdicts: list[tuple[str, bool]] = []

    # NOTE: every part's torch work on one thread, the scheduler's included, as in a
    # replica process (see engine_executor): a second thread's OpenMP team would slow
    # every step on 2 cores.
    thread = engine_executor("bench")
    rates = thread.submit(decode_scaling, args).result()
    print(f"\n1. decode over a shared {args.context}-token prefix (25.6M-parameter model)")
    for width, rate in rates.items():
        print(f"   batch {width:>3}: {rate:8.1f} tokens/s  ({rate / rates[1]:.2f}x batch 1)")
    verdicts.append(
        (f"batch 8 >= 4x batch 1 ({rates[8] / rates[1]:.2f}x)", rates[8] >= 4 * rates[1])
    )

    prefill, decode = thread.submit(tiny_engine_steps, args).result()
    span_prefill, span_decode, tokens = asyncio.run(_tiny_spans(args, thread))
    thread.shutdown()
    new = args.tiny_prompt - args.tiny_cached
    print(f"\n2. tiny model, {args.tiny_prompt}-token prompt, {args.tiny_cached} cached, {new} new")
    print(f"   engine prefill step        {prefill * 1e3:7.2f} ms")
    print(f"   scheduler prefill span     {span_prefill * 1e3:7.2f} ms")
    print(f"   engine decode step (b=1)   {decode * 1e3:7.3f} ms")
    print(f"   scheduler decode per token {span_decode * 1e3:7.3f} ms  ({tokens} tokens)")
    verdicts.append((f"prefill span <= 10 ms ({span_prefill * 1e3:.1f})", span_prefill <= 0.010))
    verdicts.append((f"decode step <= 1 ms ({span_decode * 1e3:.2f})", span_decode <= 0.001))

    # NOTE: measured before part 3, whose probe is a child process of this one.
    share = others.share()
    if not args.skip_128k:
        r = long_prefill(args.long, args.chunk)
        mask = args.long * args.long
        print(f"\n3. {args.long}-token prompt on the tiny model, {args.chunk}-token chunks")
        rate = args.long / r["seconds"]
        print(f"   prefill time        {r['seconds']:8.1f} s ({rate:,.0f} tokens/s)")
        print(f"   peak RSS growth     {r['growth_bytes'] / 2**20:8.1f} MiB")
        print(f"   KV pool (allocated) {r['pool_bytes'] / 2**20:8.1f} MiB")
        print(f"   an N x N bool mask  {mask / 2**20:8.1f} MiB (not built)")
        verdicts.append(
            (
                f"128k peak growth below 1% of an N x N mask ({r['growth_bytes'] / mask:.2%})",
                r["growth_bytes"] < mask / 100,
            )
        )

    if share is not None:
        busy = "  WARNING: machine busy, timings unreliable" if share > 0.1 else ""
        print(f"\nother processes used {share:.0%} of the CPUs during parts 1 and 2{busy}")
    print()
    for text, ok in verdicts:
        print(f"target: {text}: {'MET' if ok else 'NOT MET'}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
