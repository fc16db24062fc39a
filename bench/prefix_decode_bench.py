"""A decode batch whose lanes share a system prompt, its blocks consecutive or
scattered: one step's time on the torch engine, in process.

A replica that has served for a while hands out blocks in the order its eviction
freed them, so a new system prompt's blocks are rarely consecutive. The decode
cascade reads a shared prefix once for all lanes, one attention call per run of
consecutive blocks; it now stops at the first short run and leaves the rest to each
lane's own reads (engine/attention_plan.py, plan_decode). This prints the step time
with the prefix in one run and in runs of one block (every other pool block).

    .venv/bin/python bench/prefix_decode_bench.py                 # SmolLM2, 4 lanes, 2k prefix
    .venv/bin/python bench/prefix_decode_bench.py --model tiny    # random tiny model (fast)
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from cachepoint.engine import DecodeRequest, Engine, EngineConfig, ModelConfig, PrefillRequest
from cachepoint.engine.weights import read_model_config

BLOCK = 16


def build(model: str, blocks: int) -> Engine:
    if model == "tiny":
        config = ModelConfig.tiny()
        per_token = config.kv_bytes_per_token("float32")
        cfg = EngineConfig(
            device="cpu",
            block_size=BLOCK,
            kv_cache_bytes=blocks * BLOCK * per_token,
            max_model_len=blocks * BLOCK,
        )
        return Engine(config, cfg)
    from cachepoint.replica.model_source import preset_path

    gguf = preset_path(model)
    per_token = read_model_config(gguf).kv_bytes_per_token("float32")
    cfg = EngineConfig(
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        kv_cache_bytes=blocks * BLOCK * per_token,
        max_model_len=blocks * BLOCK,
        max_num_batched_tokens=blocks * BLOCK,
    )
    return Engine(config=cfg, model_dir=gguf)


def step_ms(
    engine: Engine, shared: list[int], prefix: list[int], lanes: int, steps: int, rng: random.Random
) -> float:
    """Prefill ``lanes`` sequences on the shared prefix blocks (each its own tail), then
    the mean time of ``steps`` decode steps of all of them."""
    vocab = engine.vocab_size
    base = max(shared) + 1
    own = 4  # private blocks a lane: its 20-token tail and the decoded tokens
    tables = [shared + list(range(base + own * i, base + own * (i + 1))) for i in range(lanes)]
    cached = len(prefix)
    for i, table in enumerate(tables):
        tokens = prefix + [rng.randrange(1, vocab) for _ in range(20)]
        engine.prefill([PrefillRequest(tokens, table, 0 if i == 0 else cached, seq_id=i)])
    at = cached + 20

    def step(k: int) -> None:
        engine.decode([DecodeRequest(1, at + k, t, seq_id=i) for i, t in enumerate(tables)])

    step(0)  # untimed: first shapes
    t0 = time.perf_counter()
    for k in range(1, steps + 1):
        step(k)
    ms = (time.perf_counter() - t0) / steps * 1e3
    for i in range(lanes):
        engine.forget(i)
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a preset (smollm2) or tiny (random)")
    p.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens (2000)")
    p.add_argument("--lanes", type=int, default=4, help="decoding sequences (4)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps (16)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each layout once (2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    args = p.parse_args(argv)
    if args.prefix < BLOCK or args.lanes < 2:
        p.error("--prefix must cover a block and --lanes be at least 2")
    torch.set_num_threads(args.threads)
    full = args.prefix // BLOCK
    prefix_len = full * BLOCK
    # every other block for the scattered layout, then 4 private blocks a lane
    engine = build(args.model, 2 * full + 4 * args.lanes + 1)
    rng = random.Random(0)
    prefix = [rng.randrange(1, engine.vocab_size) for _ in range(prefix_len)]
    layouts = {
        "one run": list(range(full)),
        "runs of 1 block": list(range(0, 2 * full, 2)),
    }
    print(
        f"{args.model}, {args.lanes} lanes on a {prefix_len}-token shared prefix, "
        f"{args.threads} threads, mean of {args.steps} steps"
    )
    for r in range(args.rounds):
        for name, shared in layouts.items():
            ms = step_ms(engine, shared, prefix, args.lanes, args.steps, rng)
            print(f"round {r}: prefix in {name}: {ms:.1f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
