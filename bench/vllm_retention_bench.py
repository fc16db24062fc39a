"""TTL retention on vLLM (issue 31): the embedded stack on vLLM replicas, with and
without the retention connector, under pool pressure; and the connector's cost.

Run:  .venv/bin/python bench/vllm_retention_bench.py [--rounds 2] [--cycles 3]

Each round starts a fresh `cachepoint up --engine vllm` stack (one vLLM replica from
.venv-vllm, the random "small" model with the byte tokenizer, so one character is one
token, and a --kv-budget pool), once with the connector (the default) and once with
CACHEPOINT_REPLICA_VLLM_RETENTION=false; rounds alternate the two, so drift in the
machine hits both alike. Through the official anthropic SDK (streaming):

- org A writes a 1h entry: a --entry-tokens system prompt with cache_control;
- then --cycles times: other orgs send distinct unmarked prompts totalling
  --flood-factor times the replica's whole pool, then A repeats its request. Reported
  per repeat: the billed cache reads, the billed cache writes, and TTFT (to the SSE
  message_start, sent once prefill is done); and, sampled after every request, the
  replica's pinned share (retained blocks / pool blocks, /v1/stats);
- finally 32 concurrent requests (distinct marked prompts, --decode-tokens each): the
  output tokens/s, and with the connector its scheduler-side seconds over the wall
  time of that burst (/v1/stats connector_seconds: time inside vLLM's busy loop, which
  is busy throughout), its cost per step.

Targets (exit status 1 when one is missed): with the connector every repeat is billed
as a read of the whole entry and no write; without it the repeats are writes (the
pressure was real); the connector's share of the burst's time is under 2%.
Figures: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx

from cachepoint.embedded.stack import Stack, StackError, free_port
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_key, create_org

BURST = 32  # concurrent requests for the connector's cost


@dataclass
class Round:
    mode: str  # "connector" or "none"
    reads: list[int] = field(default_factory=list)  # billed cache reads per repeat
    writes: list[int] = field(default_factory=list)  # billed cache writes per repeat
    ttft_s: list[float] = field(default_factory=list)  # per repeat
    first_write: int = 0  # the entry's first write
    pinned_share: list[float] = field(default_factory=list)  # after every request
    lapsed: int = 0  # /v1/stats lapsed_entries at the end
    burst_tok_s: float = 0.0  # output tokens/s of the 32-request burst
    connector_share: float | None = None  # connector seconds / burst wall time


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))


def org_key(stack: Stack, name: str) -> str:
    engine = make_engine(stack.db_url)
    with make_sessionmaker(engine)() as s:
        org = create_org(s, name)
        _, key = create_key(s, org)
        s.commit()
    engine.dispose()
    return key


def replica_stats(stack: Stack) -> dict[str, Any]:
    url = stack.endpoint()["replicas"][0]["url"]
    assert stack.credentials is not None
    auth = {"Authorization": f"Bearer {stack.credentials.internal_token}"}
    r = httpx.get(f"{url}/v1/stats", headers=auth, timeout=10)
    r.raise_for_status()
    return r.json()


def ask(client: anthropic.Anthropic, model: str, system: Any, user: str, max_tokens: int = 2):
    """One streamed request: (usage, TTFT in seconds)."""
    t0 = time.perf_counter()
    ttft = 0.0
    with client.messages.stream(
        model=model,
        max_tokens=max_tokens,
        system=system,
        messages=[{"role": "user", "content": user}],
    ) as s:
        for ev in s:
            if ev.type == "message_start" and not ttft:
                ttft = time.perf_counter() - t0
        final = s.get_final_message()
    return final.usage, ttft


def run_round(args: argparse.Namespace, mode: str, seed: int) -> Round:
    out = Round(mode)
    if mode == "none":
        os.environ["CACHEPOINT_REPLICA_VLLM_RETENTION"] = "false"
    else:
        os.environ.pop("CACHEPOINT_REPLICA_VLLM_RETENTION", None)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="vllm-retention-bench-") as tmp:
        stack = Stack(
            state_dir=Path(tmp),
            replicas=1,
            port=free_port(),
            engine="vllm",
            tokenizer="bytes",
            kv_budget=args.kv_budget,
            tracing=False,
            min_cacheable_tokens=256,
        )
        print(f"[{mode}] starting the stack (vLLM: about a minute)", flush=True)
        stack.start()
        try:
            model = stack.served_model()
            base = stack.endpoint()["base_url"]
            a = anthropic.Anthropic(base_url=base, api_key=org_key(stack, "bench-a"), max_retries=0)
            others = [
                anthropic.Anthropic(
                    base_url=base, api_key=org_key(stack, f"bench-o{i}"), max_retries=0
                )
                for i in range(4)
            ]
            total = replica_stats(stack)["blocks"]["total"]
            pool_tokens = total * replica_stats(stack)["block_size"]

            def sample() -> None:
                st = replica_stats(stack)
                out.pinned_share.append(st["blocks"]["retained"] / max(1, st["blocks"]["total"]))

            system = [
                {
                    "type": "text",
                    "text": text(rng, args.entry_tokens),
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ]
            question = "what does it say?"
            usage, _ = ask(a, model, system, question)
            out.first_write = usage.cache_creation_input_tokens or 0
            sample()
            for c in range(args.cycles):
                flooded = 0
                i = 0
                while flooded < args.flood_factor * pool_tokens:
                    ask(others[i % len(others)], model, text(rng, 32), text(rng, 1600))
                    flooded += 1600
                    i += 1
                    sample()
                usage, ttft = ask(a, model, system, question)
                out.reads.append(usage.cache_read_input_tokens or 0)
                out.writes.append(usage.cache_creation_input_tokens or 0)
                out.ttft_s.append(ttft)
                sample()
                print(
                    f"[{mode}] cycle {c}: flood {flooded} tokens ({flooded / pool_tokens:.1f} "
                    f"pools); repeat read {out.reads[-1]}, wrote {out.writes[-1]}, "
                    f"TTFT {ttft * 1e3:.0f} ms",
                    flush=True,
                )
            out.lapsed = replica_stats(stack)["lapsed_entries"]
            before = replica_stats(stack).get("connector_seconds")
            tokens: list[int] = []
            lock = threading.Lock()

            def one(i: int) -> None:
                sys_block = [
                    {
                        "type": "text",
                        "text": text(random.Random(seed * 1000 + i), 300),
                        "cache_control": {"type": "ephemeral"},
                    }
                ]
                u, _ = ask(others[i % len(others)], model, sys_block, "go", args.decode_tokens)
                with lock:
                    tokens.append(u.output_tokens)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = replica_stats(stack).get("connector_seconds")
            out.burst_tok_s = sum(tokens) / wall
            if before is not None and after is not None:
                out.connector_share = (after - before) / wall
        finally:
            stack.stop()
    return out


def summary(rounds: list[Round]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for mode in ("connector", "none"):
        rs = [r for r in rounds if r.mode == mode]
        ttft = [t for r in rs for t in r.ttft_s]
        shares = [s for r in rs if r.connector_share is not None for s in [r.connector_share]]
        res[mode] = {
            "entry_written": [r.first_write for r in rs],
            "repeat_reads": [x for r in rs for x in r.reads],
            "repeat_writes": [x for r in rs for x in r.writes],
            "repeat_ttft_ms_mean": round(statistics.mean(ttft) * 1e3, 1) if ttft else None,
            "pinned_share_max": round(max((s for r in rs for s in r.pinned_share), default=0), 3),
            "pinned_share_series": [[round(s, 3) for s in r.pinned_share] for r in rs],
            "lapsed_entries": [r.lapsed for r in rs],
            "burst_output_tok_s": [round(r.burst_tok_s, 1) for r in rs],
            "connector_share_of_burst": [round(s, 5) for s in shares],
        }
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating (2)")
    p.add_argument("--cycles", type=int, default=3, help="flood-then-repeat cycles (3)")
    p.add_argument("--kv-budget", default="32MiB", help="the replica's pool (32MiB)")
    p.add_argument("--entry-tokens", type=int, default=1500, help="org A's entry (1500)")
    p.add_argument("--flood-factor", type=float, default=3.0, help="pools of flood (3)")
    p.add_argument("--decode-tokens", type=int, default=32, help="burst output tokens (32)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    rounds: list[Round] = []
    try:
        for r in range(args.rounds):
            for mode in ("connector", "none") if r % 2 == 0 else ("none", "connector"):
                rounds.append(run_round(args, mode, seed=r))
    except StackError as exc:
        print(f"vllm_retention_bench: {exc}", file=sys.stderr)
        return 2
    res = summary(rounds)
    print(json.dumps(res, indent=2))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    missed = []
    entry = max(res["connector"]["entry_written"], default=0)
    if not entry or any(x != entry for x in res["connector"]["repeat_reads"]):
        missed.append("with the connector, a repeat was not a read of the whole entry")
    if any(res["connector"]["repeat_writes"]):
        missed.append("with the connector, a repeat wrote")
    if not all(res["none"]["repeat_writes"]):
        missed.append("without the connector a repeat was still read: no real pressure")
    if any(s >= 0.02 for s in res["connector"]["connector_share_of_burst"]):
        missed.append("the connector took 2% or more of the burst's time")
    for m in missed:
        print(f"target missed: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
