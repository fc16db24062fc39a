"""Many long generations on a KV pool far smaller than they need.

By default: 32 concurrent requests with ``max_tokens`` 32,000 (``ignore_eos``) on the
tiny random model, with a KV pool that holds a tenth of their total
(32 x (prompt + 32,000) tokens). Every request must complete with all its tokens: the
scheduler grows sequences on demand and preempts (recompute) when the pool is full.
Prints wall time, tokens generated, tokens/s, preemptions (the scheduler's count and
the ``cachepoint_replica_preemptions_total`` metric) and how many completed; a progress
line goes to stderr while it runs.

    .venv/bin/python bench/preempt_bench.py                      # the full target
    .venv/bin/python bench/preempt_bench.py --max-tokens 2000    # scaled down (CPU)
    .venv/bin/python bench/preempt_bench.py --help
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.loop import TorchCore, engine_executor
from cachepoint.replica.metrics import ReplicaMetrics
from cachepoint.replica.random_model import RANDOM_CONTEXT
from cachepoint.replica.sequence import SequenceState
from cachepoint.replica.settings import ReplicaSettings

NAME = "preempt-bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=32, help="concurrent requests (32)")
    p.add_argument("--max-tokens", type=int, default=32000, help="tokens each (32000)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens each (64)")
    p.add_argument(
        "--pool-frac",
        type=float,
        default=0.1,
        help="KV pool as a share of requests x (prompt + max_tokens) tokens (0.1); never "
        "less than one whole sequence",
    )
    p.add_argument(
        "--host-frac",
        type=float,
        default=0.0,
        help="a host KV tier behind the pool, as a share of the same total (0: none); "
        "with one, a preemption is a swap: the victim's blocks are demoted and promoted back",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step (2048)"
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts (0)")
    p.add_argument(
        "--timeout", type=float, default=24 * 3600, help="give up after this many seconds"
    )
    p.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    for flag in ("requests", "max_tokens", "prompt", "block_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 < args.pool_frac <= 1:
        p.error("--pool-frac must be in (0, 1]")
    if not 0 <= args.host_frac <= 4:
        p.error("--host-frac must be in [0, 4]")
    return args


def build(
    args: argparse.Namespace, thread: ThreadPoolExecutor
) -> tuple[TorchCore, ReplicaMetrics, int]:
    """The engine, built on ``thread`` (as the replica builds it: see engine_executor),
    and a scheduler stepping it there on a pool of the asked size; returns its blocks."""
    seq_len = args.prompt + args.max_tokens
    model = ModelConfig.tiny(max_position_embeddings=max(RANDOM_CONTEXT, seq_len))
    total = args.requests * seq_len
    blocks = max(
        math.ceil(args.pool_frac * total / args.block_size), -(-seq_len // args.block_size)
    )
    dtype = "float32"  # NOTE: the CPU's; on a GPU the pool is capped by num_blocks below
    kv_bytes = blocks * args.block_size * model.kv_bytes_per_token(dtype)
    host_slots = math.ceil(args.host_frac * total / args.block_size)
    config = EngineConfig(
        host_kv_slots=host_slots,
        block_size=args.block_size,
        device=args.device,
        kv_cache_bytes=kv_bytes,
        max_model_len=seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = thread.submit(Engine, model, config, seed=args.seed).result()
    settings = ReplicaSettings(
        name=NAME,
        max_num_seqs=max(32, args.requests),
        max_waiting=max(256, args.requests),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    # NOTE: on a GPU the engine sizes its pool by free memory; the scheduler's cap makes
    # the pool the asked size there too.
    sched = TorchCore(
        engine, settings, num_blocks=min(blocks, engine.num_blocks), engine_thread=thread
    )
    return sched, ReplicaMetrics(sched), sched.pool.num_blocks


async def run(args: argparse.Namespace) -> int:
    thread = engine_executor(NAME)
    sched, metrics, blocks = build(args, thread)
    rng = random.Random(args.seed)
    vocab = sched.engine.vocab_size
    print(
        f"# {args.requests} requests x (prompt {args.prompt} + max_tokens {args.max_tokens}) "
        f"on {blocks} blocks of {args.block_size} ({blocks * args.block_size} tokens, "
        f"{blocks * args.block_size / (args.requests * (args.prompt + args.max_tokens)):.3f} "
        f"of the total), host tier {sched.engine.host_kv_slots} blocks, "
        f"device {sched.engine.device}, torch {torch.__version__}",
        flush=True,
    )
    sched.start()
    t0 = time.perf_counter()
    seqs: list[SequenceState] = []
    try:
        for _ in range(args.requests):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt)]
            req = GenerateRequest(token_ids=prompt, max_tokens=args.max_tokens, ignore_eos=True)
            seqs.append(sched.submit(req))
        for q in seqs:  # NOTE: nobody reads the streams: drop them as they fill
            q.stream = _Discard()  # type: ignore[assignment]
        waiter = asyncio.gather(*(asyncio.shield(q.done) for q in seqs), return_exceptions=True)
        deadline = t0 + args.timeout
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=args.progress_s)
            now = time.perf_counter()
            made = sum(len(q.output) for q in seqs)
            print(
                f"[{now - t0:8.1f}s] tokens {made}/{args.requests * args.max_tokens} "
                f"({made / (now - t0):.0f}/s) running {len(sched.running)} waiting "
                f"{len(sched.waiting)} preemptions {sched.preemptions} steps {sched.steps}",
                file=sys.stderr,
                flush=True,
            )
            if now > deadline:
                print(f"timed out after {args.timeout:.0f}s", file=sys.stderr)
                break
        wall = time.perf_counter() - t0
    finally:
        await sched.stop()
        thread.shutdown()
    completed = sum(
        1 for q in seqs if q.stop_reason is not None and len(q.output) == args.max_tokens
    )
    tokens = sum(len(q.output) for q in seqs)
    metric = metrics.registry.get_sample_value(
        "cachepoint_replica_preemptions_total", {"replica": NAME}
    )
    print(f"wall_s              {wall:.2f}")
    print(f"total_tokens        {tokens}")
    print(f"tokens_per_s        {tokens / wall:.1f}")
    print(f"preemptions         {sched.preemptions}")
    print(f"preemptions_metric  {metric:.0f}" if metric is not None else "preemptions_metric  -")
    print(f"completed           {completed}/{args.requests}")
    print(f"engine_steps        {sched.steps}")
    for t in sched.cache_stats().tiers:
        print(
            f"{t.tier}_tier           hits {t.hits} promoted {t.promotions} demoted "
            f"{t.demotions} dropped {t.dropped} (blocks); copies {sched.copy_s:.1f}s"
        )
    return 0 if completed == args.requests else 1


class _Discard:
    """A stream nobody reads: what the scheduler puts in it is dropped."""

    def put_nowait(self, item: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
