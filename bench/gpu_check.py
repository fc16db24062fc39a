"""One GPU check of the engine, for the day a device is lent: under 5 minutes on
one H200, downloads nothing (random weights, Llama-3-8B shapes, bfloat16).

Prints one table:

- paged attention: ``cuda_paged_attention`` against the float64 reference over random
  block tables and a prefill/decode mix (max abs error, tolerance 2e-2 in bf16);
- reuse equals recompute: last-token logits of a prompt prefilled cold vs with its
  first half cached (bf16 tolerance: max abs difference <= 5% of the cold logits' max
  abs value, and the same argmax);
- cold and cached TTFT at 8k and 32k tokens (cached: all but the last 64 in the pool);
- decode tokens/s at batch 1, 32 and 128, every lane on one shared 1,024-token prefix
  (the prefix's blocks are shared; each lane grows its own blocks);
- the KV pool the engine chose (blocks, GiB) and the peak memory;
- with ``--engine vllm`` (or ``both``), the same shapes on vLLM: its own
  random weights (``load_format="dummy"``), prefix caching on, reuse equals recompute
  (greedy token and its logprob, cold against cached), cold and cached TTFT (with the
  tokens vLLM reports it reused), and decode tokens/s at each batch; a SKIP row where
  vLLM is not installed.

Exit code 0 when every check passed or was skipped, 1 when one failed or raised, 2
when the device asked for does not exist.

    python3 bench/gpu_check.py                        # on the GPU machine
    python3 bench/gpu_check.py --engine both          # also vLLM, where it is installed
    .venv/bin/python bench/gpu_check.py --device cpu --tiny   # dry run of the script
    .venv-vllm/bin/python bench/gpu_check.py --device cpu --tiny --engine vllm
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import random
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TAIL = 64  # uncached tokens of a "cached" TTFT prompt
ATTN_ATOL = 2e-2  # bf16 kernel vs float64 reference
REUSE_RTOL = 0.05  # max |cold - cached| over max |cold|, bf16 through every layer


def _import_cachepoint() -> None:
    """Make ``cachepoint.engine`` importable from this checkout without installing it
    (the GPU machine has no network and no install step): the folders setup.py maps.

    NOTE: so every import of cachepoint in this script sits in the function that uses
    it, run after this one; one at the top would fail before it could run."""
    try:
        import cachepoint.engine  # noqa: F401

        return
    except ImportError:
        pass
    for name, folder in (
        ("cachepoint", "services/cachepoint"),
        ("cachepoint.tokenizer", "services/tokenizer"),
        ("cachepoint.engine", "services/engine"),
    ):
        path = ROOT / folder
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


@dataclass(slots=True)
class Sizes:
    """What one run measures."""

    block_size: int  # engine block size (256 on CUDA: the paged kernel's page multiple)
    reuse_tokens: int  # prompt length of the reuse check
    ttft_tokens: tuple[int, ...]  # prompt lengths of the TTFT rows
    decode_batches: tuple[int, ...]  # batch sizes of the decode rows
    prefix_tokens: int  # shared prefix of the decode lanes
    decode_steps: int  # timed steps per decode row
    attn_block_size: int  # block size of the kernel-vs-reference check
    attn_contexts: tuple[int, ...]  # context lengths there (prefills then decodes)
    attn_queries: tuple[int, ...]  # their query counts


FULL = Sizes(
    block_size=256,
    reuse_tokens=4096,
    ttft_tokens=(8192, 32768),
    decode_batches=(1, 32, 128),
    prefix_tokens=1024,
    decode_steps=32,
    attn_block_size=256,
    attn_contexts=(2000, 5000, 300, 1, 4097, 700),
    attn_queries=(2000, 300, 1, 1, 1, 1),
)
TINY = Sizes(
    block_size=16,
    reuse_tokens=96,
    ttft_tokens=(256, 512),
    decode_batches=(1, 4, 8),
    prefix_tokens=64,
    decode_steps=4,
    attn_block_size=16,
    attn_contexts=(40, 70, 9, 1),
    attn_queries=(40, 5, 1, 1),
)


def llama3_8b() -> Any:
    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine import ModelConfig

    return ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=32768 + 1024,
        dtype="bfloat16",
    )


@dataclass(slots=True)
class Row:
    """One line of the table."""

    check: str  # what was measured
    status: str  # PASS, FAIL, INFO, SKIP or ERROR
    value: str  # the figure
    detail: str = ""  # tolerance, shape or error


@dataclass(slots=True)
class Ctx:
    """The run's engine and settings."""

    args: argparse.Namespace  # the command line
    sizes: Sizes  # what to measure
    device: torch.device  # where
    engine: Any = None  # cachepoint.engine.Engine, once built
    alloc: Any = None  # its BlockAllocator
    rows: list[Row] = field(default_factory=list)  # the table so far
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # token ids


def _sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _tokens(ctx: Ctx, n: int) -> list[int]:
    vocab = ctx.engine.vocab_size
    return [ctx.rng.randrange(vocab) for _ in range(n)]


def _table(ctx: Ctx, n_tokens: int) -> list[int]:
    return list(ctx.alloc(math.ceil(n_tokens / ctx.engine.block_size)))


def _prefill(ctx: Ctx, ids: list[int], table: list[int], cached: int = 0) -> torch.Tensor:
    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine import PrefillRequest

    out = ctx.engine.prefill([PrefillRequest(ids, table, cached)])
    logits: torch.Tensor = out.prefill_logits[0]
    return logits


# -- checks: each appends rows or raises -----------------------------------------------


def attention_case(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> tuple[Any, ...]:
    """Random queries, pool (32 query / 8 KV heads, head_dim 128) and block tables (a
    random permutation of the blocks, 0-padded), in ``cuda_paged_attention``'s order."""
    hq, hkv, d, bs = 32, 8, 128, sizes.attn_block_size
    gen = torch.Generator(device="cpu").manual_seed(1)
    need = [math.ceil(n / bs) for n in sizes.attn_contexts]
    ids = torch.randperm(sum(need) + 4, generator=gen)
    tables = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = ids[at : at + nb].to(torch.int32)
        at += nb
    num_blocks = int(ids.numel())
    k = torch.randn(hkv, num_blocks, bs, d, generator=gen).to(device, dtype)
    v = torch.randn(hkv, num_blocks, bs, d, generator=gen).to(device, dtype)
    q = torch.randn(sum(sizes.attn_queries), hq, d, generator=gen).to(device, dtype)
    cu = [0, *torch.tensor(sizes.attn_queries).cumsum(0).tolist()]
    return (
        q,
        k,
        v,
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor(sizes.attn_contexts, dtype=torch.int32, device=device),
        tables.to(device),
        max(sizes.attn_queries),
        max(sizes.attn_contexts),
    )


def check_attention(ctx: Ctx) -> None:
    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine.attention_cuda import (
        cuda_paged_attention,
        cuda_paged_attention_available,
        reference_paged_attention,
    )

    s, name = ctx.sizes, "paged attention vs reference"
    dtype = torch.bfloat16
    args = attention_case(s, ctx.device, dtype)
    want = reference_paged_attention(*args)  # also runs in the CPU dry run
    ok, why = cuda_paged_attention_available(s.attn_block_size, dtype)
    if ctx.device.type != "cuda" or not ok:
        ctx.rows.append(Row(name, "SKIP", "-", f"reference ran; kernel unavailable: {why}"))
        return
    got = cuda_paged_attention(*args)
    err = float((got.float() - want.float()).abs().max())
    shape = f"bs {s.attn_block_size}, q {s.attn_queries} over k {s.attn_contexts}"
    status = "PASS" if err <= ATTN_ATOL else "FAIL"
    ctx.rows.append(Row(name, status, f"max abs err {err:.2e}", f"atol {ATTN_ATOL}; {shape}"))


def check_reuse(ctx: Ctx) -> None:
    n = ctx.sizes.reuse_tokens
    ids = _tokens(ctx, n)
    cold_table, warm_table = _table(ctx, n), _table(ctx, n)
    try:
        cold = _prefill(ctx, ids, cold_table).float()
        half = n // 2
        _prefill(ctx, ids[:half], warm_table)
        warm = _prefill(ctx, ids, warm_table, cached=half).float()
    finally:
        ctx.alloc.release(cold_table)
        ctx.alloc.release(warm_table)
    diff = float((cold - warm).abs().max())
    scale = float(cold.abs().max())
    same_argmax = int(cold.argmax()) == int(warm.argmax())
    ok = diff <= REUSE_RTOL * scale and same_argmax
    ctx.rows.append(
        Row(
            f"reuse == recompute ({n} tok, half cached)",
            "PASS" if ok else "FAIL",
            f"max abs diff {diff:.3e}",
            f"tol {REUSE_RTOL} x max|logit| = {REUSE_RTOL * scale:.3e}; "
            f"argmax equal: {same_argmax}",
        )
    )


def check_ttft(ctx: Ctx, n: int) -> None:
    ids = _tokens(ctx, n)
    table = _table(ctx, n)
    try:
        _sync(ctx)
        t0 = time.perf_counter()
        _prefill(ctx, ids, table)  # the engine synchronizes before returning logits
        cold = time.perf_counter() - t0
        # The cold run left every position in the pool; recompute only the last TAIL.
        _sync(ctx)
        t0 = time.perf_counter()
        _prefill(ctx, ids, table, cached=n - TAIL)
        warm = time.perf_counter() - t0
    finally:
        ctx.alloc.release(table)
    ctx.rows.append(Row(f"TTFT cold, {n} tokens", "INFO", f"{cold * 1e3:.1f} ms"))
    ctx.rows.append(
        Row(
            f"TTFT cached, {n} tokens ({n - TAIL} in pool)",
            "INFO",
            f"{warm * 1e3:.1f} ms",
            f"{cold / warm:.1f}x faster than cold",
        )
    )


def check_decode(ctx: Ctx, batch: int) -> None:
    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine import DecodeRequest

    s, bs = ctx.sizes, ctx.engine.block_size
    prefix = _tokens(ctx, s.prefix_tokens)
    shared = _table(ctx, s.prefix_tokens)
    # NOTE: the prefix is block-aligned, so its blocks are shared read-only and every
    # lane writes only into blocks of its own.
    assert s.prefix_tokens % bs == 0
    owned: list[list[int]] = [[] for _ in range(batch)]
    try:
        logits = _prefill(ctx, prefix, shared)
        tokens = [int(logits.argmax())] * batch
        warmup = 2
        t0 = 0.0
        for step in range(warmup + s.decode_steps):
            if step == warmup:
                _sync(ctx)
                t0 = time.perf_counter()
            pos = s.prefix_tokens + step
            if pos % bs == 0:
                for lane in owned:
                    lane.extend(ctx.alloc(1))
            reqs = [
                DecodeRequest(tok, pos, shared + lane)
                for tok, lane in zip(tokens, owned, strict=True)
            ]
            tokens = ctx.engine.decode(reqs).argmax(-1).tolist()
        elapsed = time.perf_counter() - t0
    finally:
        ctx.alloc.release(shared)
        for lane in owned:
            ctx.alloc.release(lane)
    rate = batch * s.decode_steps / elapsed
    ctx.rows.append(
        Row(
            f"decode, batch {batch}",
            "INFO",
            f"{rate:.1f} tok/s",
            f"{elapsed / s.decode_steps * 1e3:.2f} ms/step; shared {s.prefix_tokens}-token prefix",
        )
    )


# -- the vLLM case ---------------------------------------------------------------------


def _vllm_llm(ctx: Ctx, folder: Path) -> Any:
    """vLLM's offline engine on ``folder``'s config, random weights, prefix caching on."""
    from vllm import LLM

    s, cpu = ctx.sizes, ctx.device.type == "cpu"
    longest = max(*s.ttft_tokens, s.reuse_tokens, s.prefix_tokens + s.decode_steps + 2)
    kw: dict[str, Any] = (
        {"kv_cache_memory_bytes": 256 << 20}
        if cpu
        else {"gpu_memory_utilization": ctx.args.gpu_memory_utilization}
    )
    return LLM(
        model=str(folder),
        load_format="dummy",  # random weights of the config's shapes: nothing downloaded
        skip_tokenizer_init=True,
        dtype="float32" if cpu else "bfloat16",
        # NOTE: vLLM's CPU attention takes multiples of 32; on CUDA 16 is its default.
        block_size=32 if cpu else 16,
        enable_prefix_caching=True,
        max_model_len=longest + 64,
        max_num_seqs=max(s.decode_batches),
        enforce_eager=cpu,
        seed=0,
        **kw,
    )


def check_vllm(ctx: Ctx) -> None:
    """The vLLM rows: the same shapes as the torch engine's, on vLLM's engine."""
    if importlib.util.find_spec("vllm") is None:
        ctx.rows.append(Row("vLLM", "SKIP", "-", "vllm is not installed in this Python"))
        return
    import tempfile

    from vllm import SamplingParams

    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine import ModelConfig

    s = ctx.sizes
    if ctx.args.tiny:  # vLLM's CPU attention takes head sizes of 32 and more
        model = ModelConfig.tiny(hidden_size=128, num_heads=4, num_kv_heads=2)
    else:
        model = llama3_8b()
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        folder = Path(tmp)
        hf = model.to_hf_config()
        hf["torch_dtype"] = "float32" if ctx.device.type == "cpu" else "bfloat16"
        (folder / "config.json").write_text(__import__("json").dumps(hf))
        t0 = time.perf_counter()
        llm = _vllm_llm(ctx, folder)
        build = time.perf_counter() - t0
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        ctx.rows.append(Row("vLLM: engine build (dummy weights)", "INFO", f"{build:.1f} s",
                            f"{blocks} KV blocks"))  # fmt: skip
        vocab = model.vocab_size

        def prompt(n: int) -> dict[str, Any]:
            return {"prompt_token_ids": [ctx.rng.randrange(vocab) for _ in range(n)]}

        def first(p: dict[str, Any]) -> tuple[float, Any]:
            t = time.perf_counter()
            params = SamplingParams(max_tokens=1, logprobs=1, temperature=0.0)
            (out,) = llm.generate([p], params, use_tqdm=False)
            return time.perf_counter() - t, out

        llm.generate([prompt(64)], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        p = prompt(s.reuse_tokens)
        _, cold = first(p)
        _, warm = first(p)
        c, w = cold.outputs[0], warm.outputs[0]
        lp_c = c.logprobs[0][c.token_ids[0]].logprob
        lp_w = w.logprobs[0][w.token_ids[0]].logprob
        ok = c.token_ids == w.token_ids and abs(lp_c - lp_w) <= 0.05 * max(1.0, abs(lp_c))
        same = c.token_ids == w.token_ids
        ctx.rows.append(
            Row(
                f"vLLM: reuse == recompute ({s.reuse_tokens} tok)",
                "PASS" if ok else "FAIL",
                f"logprob {lp_c:.4f} vs {lp_w:.4f}",
                f"{warm.num_cached_tokens} tokens reused; same greedy token: {same}",
            )
        )
        for n in s.ttft_tokens:
            p = prompt(n)
            t_cold, _ = first(p)
            t_warm, out = first(p)
            ctx.rows.append(Row(f"vLLM: TTFT cold, {n} tokens", "INFO", f"{t_cold * 1e3:.1f} ms"))
            speedup = f"{out.num_cached_tokens} reused; {t_cold / t_warm:.1f}x faster"
            ctx.rows.append(
                Row(f"vLLM: TTFT cached, {n} tokens", "INFO", f"{t_warm * 1e3:.1f} ms", speedup)
            )
        prefix = prompt(s.prefix_tokens)
        llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)  # cache it
        for b in s.decode_batches:
            params = SamplingParams(max_tokens=s.decode_steps, ignore_eos=True, temperature=0.0)
            t = time.perf_counter()
            llm.generate([prefix] * b, params, use_tqdm=False)
            rate = b * s.decode_steps / (time.perf_counter() - t)
            ctx.rows.append(Row(f"vLLM: decode, batch {b}", "INFO", f"{rate:.1f} tok/s",
                                f"{s.decode_steps} steps over a cached {s.prefix_tokens}-token "
                                "prefix (its last block's prefill included)"))  # fmt: skip


def check_vllm_retention(ctx: Ctx) -> None:
    """Cachepoint's retention connector inside vLLM (issue 31): pin a prefix, flood a
    small pool with other prompts (three pools' worth), then read the pinned prefix
    again. An unpinned control prefix sent before the flood must be gone (the pressure
    was real), the pinned one reused whole. With --kv-host-bytes on a GPU, vLLM's host
    tier runs behind it (MultiConnector)."""
    if importlib.util.find_spec("vllm") is None:
        ctx.rows.append(Row("vLLM retention", "SKIP", "-", "vllm is not installed in this Python"))
        return
    import json
    import tempfile

    from vllm import LLM, SamplingParams
    from vllm.config.kv_transfer import KVTransferConfig

    from cachepoint.engine import ModelConfig
    from cachepoint.replica.settings import ReplicaSettings
    from cachepoint.replica.vllm_engine.engine import connector_config
    from cachepoint.replica.vllm_engine.pins import PARAMS_KEY

    cpu = ctx.device.type == "cpu"
    block = 32 if cpu else 16
    pool = 256  # blocks: small, so three pools' worth of prompts is cheap
    if ctx.args.tiny:
        model = ModelConfig.tiny(hidden_size=128, num_heads=4, num_kv_heads=2)
    else:
        model = llama3_8b()
    settings = ReplicaSettings(engine="vllm", kv_host_bytes=ctx.args.kv_host_bytes)
    transfer = connector_config(settings, "cpu" if cpu else "cuda")
    assert transfer is not None
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-ret-") as tmp:
        folder = Path(tmp)
        hf = model.to_hf_config()
        hf["torch_dtype"] = "float32" if cpu else "bfloat16"
        (folder / "config.json").write_text(json.dumps(hf))
        t0 = time.perf_counter()
        llm = LLM(
            model=str(folder),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="float32" if cpu else "bfloat16",
            block_size=block,
            enable_prefix_caching=True,
            num_gpu_blocks_override=pool,
            max_model_len=pool * block // 2,
            enforce_eager=cpu,
            seed=0,
            kv_transfer_config=KVTransferConfig(**transfer),
            **(
                {"kv_cache_memory_bytes": 64 << 20}
                if cpu
                else {"gpu_memory_utilization": ctx.args.gpu_memory_utilization}
            ),
        )
        built = f"{time.perf_counter() - t0:.1f} s"
        name = str(transfer["kv_connector"])
        ctx.rows.append(Row("vLLM retention: engine build", "INFO", built, name))
        vocab = model.vocab_size
        n = pool * block // 4  # a quarter of the pool, pinned

        def ids(k: int) -> list[int]:
            return [ctx.rng.randrange(vocab) for _ in range(k)]

        def run(tokens: list[int], pins: list[dict[str, Any]] | None = None) -> Any:
            extra = {"kv_transfer_params": {PARAMS_KEY: {"pins": pins}}} if pins else None
            params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
            (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
            return out

        pinned, control = ids(n + 8), ids(n + 8)
        report = run(pinned, [{"key": "gpu-check", "blocks": n // block, "ttl": 600.0}])
        said = (report.kv_transfer_params or {}).get(PARAMS_KEY, {})
        run(control)
        t_flood = time.perf_counter()
        for _ in range(3 * 4 + 1):  # three pools' worth, a quarter at a time
            run(ids(n + 8))
        flood = time.perf_counter() - t_flood
        t = time.perf_counter()
        again = run(pinned)
        ttft = time.perf_counter() - t
        gone = run(control).num_cached_tokens
        ok = again.num_cached_tokens >= n and gone < n and said.get("pinned") == 1
        ctx.rows.append(
            Row(
                f"vLLM retention: pin, pressure, read ({n} tok)",
                "PASS" if ok else "FAIL",
                f"{again.num_cached_tokens} reused",
                f"control after the flood: {gone} reused; connector said {said}; "
                f"TTFT of the read {ttft * 1e3:.1f} ms; flood {flood:.1f} s",
            )
        )


def _run(ctx: Ctx, name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # NOTE: one failing check must not hide the others' rows
        traceback.print_exc(file=sys.stderr)
        ctx.rows.append(
            Row(
                name,
                "ERROR",
                type(exc).__name__,
                str(exc).splitlines()[0][:160] if str(exc) else "",
            )
        )


def build_engine(ctx: Ctx) -> None:
    # NOTE: cachepoint loads only after _import_cachepoint() (main): no install here.
    from cachepoint.engine import BlockAllocator, Engine, EngineConfig, ModelConfig

    s = ctx.sizes
    longest = max(*s.ttft_tokens, s.reuse_tokens, s.prefix_tokens + s.decode_steps + 2)
    if ctx.args.tiny:
        model = ModelConfig.tiny(max_position_embeddings=longest + s.block_size)
        extra: dict[str, Any] = {"kv_cache_bytes": 64 << 20}
    else:
        model = llama3_8b()
        extra = {"gpu_memory_utilization": ctx.args.gpu_memory_utilization}
    dtype = "bfloat16" if ctx.device.type == "cuda" else "float32"
    t0 = time.perf_counter()
    ctx.engine = Engine(
        model,
        EngineConfig(
            device=str(ctx.device),
            dtype=dtype,
            block_size=s.block_size,
            max_model_len=longest + s.block_size,
            max_num_batched_tokens=max(s.ttft_tokens),
            **extra,
        ),
        seed=0,
    )
    ctx.alloc = BlockAllocator(ctx.engine.num_blocks)
    build = time.perf_counter() - t0
    gib = ctx.engine.kv_pool_bytes / 2**30
    ctx.rows.append(
        Row(
            "engine build (random weights)",
            "INFO",
            f"{build:.1f} s",
            f"{model.num_layers} layers, hidden {model.hidden_size}, {dtype}, block {s.block_size}",
        )
    )
    ctx.rows.append(
        Row("KV pool chosen", "INFO", f"{ctx.engine.num_blocks} blocks", f"{gib:.2f} GiB")
    )
    # NOTE: a first small step pays the one-off costs (cuBLAS handles, kernel loads)
    # that would otherwise land in the first timed row.
    ids = _tokens(ctx, 2 * s.block_size)
    table = _table(ctx, len(ids))
    try:
        _prefill(ctx, ids, table)
    finally:
        ctx.alloc.release(table)


def peak_memory_row(ctx: Ctx) -> Row:
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30
        return Row("peak memory (max_memory_allocated)", "INFO", f"{peak:.2f} GiB")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return Row("peak memory (process max RSS)", "INFO", f"{rss:.2f} GiB")


def render(rows: list[Row]) -> str:
    head = Row("check", "status", "value", "detail")
    widths = [max(len(getattr(r, f)) for r in [head, *rows]) for f in ("check", "status", "value")]

    def line(r: Row) -> str:
        cells = (r.check.ljust(widths[0]), r.status.ljust(widths[1]), r.value.ljust(widths[2]))
        return " | ".join((*cells, r.detail)).rstrip()

    rule = "-+-".join("-" * w for w in widths) + "-+-" + "-" * 20
    return "\n".join([line(head), rule, *(line(r) for r in rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Engine checks on one GPU (random Llama-3-8B weights, bf16); prints one table.",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="ModelConfig.tiny() and small sizes: a dry run of the script itself (CPU)",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "vllm", "both"],
        default="torch",
        help="torch (default): Cachepoint's engine; vllm: vLLM's engine (issue 18); both",
    )
    p.add_argument(
        "--kv-host-bytes",
        default="0",
        help="with --engine vllm on a GPU: vLLM's host tier behind the retention connector "
        "(e.g. 8GiB; default 0: none; the CPU build has none)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of free GPU memory the engine may take (default 0.9)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: device {args.device!r} asked for, but torch {torch.__version__} sees "
            "no CUDA device (torch.cuda.is_available() is False); use --device cpu --tiny "
            "for a dry run",
            file=sys.stderr,
        )
        return 2
    if device.type not in ("cuda", "cpu"):
        print(f"gpu_check: unsupported device {args.device!r}", file=sys.stderr)
        return 2
    _import_cachepoint()
    torch.manual_seed(0)
    ctx = Ctx(args, TINY if args.tiny else FULL, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        name = "cpu"
    shapes = "tiny" if args.tiny else "Llama-3-8B shapes"
    print(f"gpu_check: {name}, torch {torch.__version__}, {shapes}")
    start = time.perf_counter()
    if args.engine in ("torch", "both"):
        _run(ctx, "paged attention vs reference", functools.partial(check_attention, ctx))
        if device.type == "cuda":
            # NOTE: the engine sizes its pool from free memory; give back what the
            # attention check's float64 reference cached.
            torch.cuda.empty_cache()
        _run(ctx, "engine build", functools.partial(build_engine, ctx))
        if ctx.engine is not None:
            with torch.inference_mode():
                _run(ctx, "reuse == recompute", functools.partial(check_reuse, ctx))
                for n in ctx.sizes.ttft_tokens:
                    _run(ctx, f"TTFT {n}", functools.partial(check_ttft, ctx, n))
                for b in ctx.sizes.decode_batches:
                    _run(ctx, f"decode, batch {b}", functools.partial(check_decode, ctx, b))
            ctx.rows.append(peak_memory_row(ctx))
            ctx.engine.close()
            ctx.engine = None
            if device.type == "cuda":
                torch.cuda.empty_cache()  # vLLM sizes its pool from free memory too
    if args.engine in ("vllm", "both"):
        _run(ctx, "vLLM", functools.partial(check_vllm, ctx))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _run(ctx, "vLLM retention", functools.partial(check_vllm_retention, ctx))
    ctx.rows.append(Row("wall time", "INFO", f"{time.perf_counter() - start:.1f} s"))
    print(render(ctx.rows))
    failed = [r.check for r in ctx.rows if r.status in ("FAIL", "ERROR")]
    if failed:
        print(f"gpu_check: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
