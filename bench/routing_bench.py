"""Cache-aware routing against round-robin and least-loaded, on the real embedded stack.

Run:  .venv/bin/python bench/routing_bench.py [--rounds 3] [--tenants 6] [--sessions 2] [--turns 6]

For each policy a fresh stack starts (nats-server, --replicas replicas, the gateway
with that routing policy), so every policy begins with empty caches. The same
workload then runs through the official SDK: every tenant has its own long system
prompt, marked with cache_control, and several multi-turn sessions run concurrently;
each turn's last message carries the breakpoint. Reported per policy: prompt tokens
served from cache (billed cache reads, and the engines' own prefix hits), mean and
p90 TTFT (time to the SSE message_start, which the gateway sends once prefill is done),
and the billed cost. With --rounds N the policies take turns N times (each run a
fresh stack); the table pools every round, and the verdict is computed from the
pooled figures this run measured, with each round's ratio beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx

from cachepoint.billing import Price, buckets, cost_micros
from cachepoint.embedded.stack import Stack, free_port
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_key, create_org

PRICE = Price(3_000_000, 15_000_000)
TOPICS = ["kettles", "bicycles", "tax forms", "greenhouses", "violins", "sailboats", "bonsai"]


@dataclass
class Tally:
    read: int = 0
    prompt: int = 0
    cost: int = 0
    ttft: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def system_prompt(tenant: int, tokens: int) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    line = f"You are tenant {tenant}'s support agent for {topic}; answer precisely. "
    return (line * (tokens // len(line) + 1))[:tokens]


def turn_text(sid: int, turn: int, chars: int) -> str:
    """A user turn of ``chars`` characters, private to the session."""
    head = f"session {sid} question {turn}: "
    return head + ("details " * (chars // 8 + 1))[: max(0, chars - len(head))]


def session(
    base_url: str,
    key: str,
    tenant: int,
    sid: int,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    turns, sys_tokens = args.turns, args.system_tokens
    client = anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=3, timeout=300)
    system = [
        {
            "type": "text",
            "text": system_prompt(tenant, sys_tokens),
            "cache_control": {"type": "ephemeral"},
        }
    ]
    messages: list[dict] = []
    for turn in range(turns):
        for m in messages:
            for b in m["content"]:
                b.pop("cache_control", None)
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": turn_text(sid, turn, args.turn_tokens),
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            }
        )
        t0 = time.perf_counter()
        ttft = None
        with client.messages.stream(
            model="cachepoint-tiny", max_tokens=8, system=system, messages=messages
        ) as stream:
            for event in stream:
                if event.type == "message_start" and ttft is None:
                    ttft = time.perf_counter() - t0
            final = stream.get_final_message()
        u = final.usage
        cc = u.cache_creation
        w5, w1 = (cc.ephemeral_5m_input_tokens, cc.ephemeral_1h_input_tokens) if cc else (0, 0)
        prompt = u.input_tokens + u.cache_read_input_tokens + w5 + w1
        b = buckets(prompt, u.cache_read_input_tokens, w5, w1, u.output_tokens)
        with tally.lock:
            tally.read += u.cache_read_input_tokens
            tally.prompt += prompt
            tally.cost += cost_micros(b, PRICE)
            tally.ttft.append(ttft or 0.0)
        messages.append(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": f"answer {turn} for session {sid}"}],
            }
        )


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix=f"cp-route-{policy}-"))
    stack = Stack(
        state_dir=state,
        replicas=args.replicas,
        port=free_port(),
        routing_policy=policy,
        model_preset=args.preset,
        min_cacheable_tokens=256,
        kv_budget=args.kv_budget,
    )
    stack.start()
    try:
        engine = make_engine(stack.db_url)
        with make_sessionmaker(engine)() as s:
            keys = [create_key(s, create_org(s, f"tenant-{t}"))[1] for t in range(args.tenants)]
            s.commit()
        engine.dispose()
        tally = Tally()
        threads = [
            threading.Thread(
                target=session,
                args=(stack.base_url, keys[t], t, sid, args, tally),
            )
            for t in range(args.tenants)
            for sid in range(args.sessions)
        ]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        engine_hits = 0
        # /v1/stats is internal: the stack's internal token opens it.
        token = stack.credentials.internal_token if stack.credentials else ""
        headers = {"authorization": f"Bearer {token}"} if token else {}
        for child in stack.children:
            if child.name.startswith("replica-"):
                resp = httpx.get(f"{child.url}/v1/stats", headers=headers, timeout=10)
                resp.raise_for_status()
                engine_hits += resp.json()["hit_tokens"]
    finally:
        stack.stop()
    return {
        "billed_read": tally.read,
        "engine_hits": engine_hits,
        "prompt": tally.prompt,
        "ttft": list(tally.ttft),
        "cost": tally.cost / 1e6,
        "wall": wall,
    }


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds as one run: token and cost sums, every request's TTFT."""
    ttft = sorted(t for r in runs for t in r["ttft"])
    return {
        "billed_read": sum(r["billed_read"] for r in runs),
        "engine_hits": sum(r["engine_hits"] for r in runs),
        "prompt": sum(r["prompt"] for r in runs),
        "ttft_mean": statistics.mean(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "cost": sum(r["cost"] for r in runs),
        "wall": sum(r["wall"] for r in runs),
        "requests": len(ttft),
    }


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--sessions", type=int, default=2, help="concurrent sessions per tenant")
    ap.add_argument("--turns", type=int, default=6, help="turns per session")
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=1536,
        help="system prompt length, in characters (about 4 per SmolLM2 token)",
    )
    ap.add_argument(
        "--turn-tokens",
        type=int,
        default=160,
        help="each user turn's length, in characters (the session's own text)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times each policy runs, taking turns (a fresh stack each run); the figures pool them",
    )
    ap.add_argument("--preset", default="small", choices=["tiny", "small"], help="replica model")
    ap.add_argument(
        "--kv-budget",
        default="8MiB",
        help="KV memory per replica (8MiB: less than the workload's prefixes, so a policy "
        "that scatters a tenant loses them; since the tiny model counts SmolLM2's BPE "
        "tokens, the prompts fit 32MiB and round-robin read them too)",
    )
    ap.add_argument("--policies", default="cache_aware,round_robin,least_loaded")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for rnd in range(args.rounds):
        for policy in policies:
            print(f"round {rnd + 1}/{args.rounds}: {policy} ...", file=sys.stderr, flush=True)
            runs[policy].append(run_policy(policy, args))
    results = {policy: pool(rs) for policy, rs in runs.items()}
    print(
        f"{args.tenants} tenants x {args.sessions} sessions x {args.turns} turns, "
        f"{args.system_tokens}-character system prompts, {args.turn_tokens}-character "
        f"turns, {args.replicas} replicas ({args.preset} model, {args.kv_budget} KV each), "
        f"{args.rounds} round(s) pooled"
    )
    head = (
        f"{'policy':14}{'cached (billed)':>17}{'engine hits':>13}{'of prompt':>11}"
        f"{'TTFT mean ms':>14}{'TTFT p90 ms':>13}{'cost $':>10}{'wall s':>8}"
    )
    print(head)
    for policy, r in results.items():
        print(
            f"{policy:14}{r['billed_read']:>17}{r['engine_hits']:>13}"
            f"{r['billed_read'] / r['prompt']:>11.1%}{r['ttft_mean'] * 1e3:>14.1f}"
            f"{r['ttft_p90'] * 1e3:>13.1f}{r['cost']:>10.4f}{r['wall']:>8.1f}"
        )
    if "cache_aware" in results and "round_robin" in results:
        ca, rr = results["cache_aware"], results["round_robin"]
        ratio = ca["billed_read"] / max(rr["billed_read"], 1)
        each = [
            c["billed_read"] / max(r["billed_read"], 1)
            for c, r in zip(runs["cache_aware"], runs["round_robin"], strict=True)
        ]
        p90s = [
            f"{p90(c['ttft']) * 1e3:.0f} vs {p90(r['ttft']) * 1e3:.0f}"
            for c, r in zip(runs["cache_aware"], runs["round_robin"], strict=True)
        ]
        print(
            f"cache-aware serves {ratio:.2f}x the cached tokens of round-robin "
            f"(target >= 2x: {'met' if ratio >= 2 else 'MISSED'}; each round: "
            f"{', '.join(f'{x:.2f}x' for x in each)}); p90 TTFT "
            f"{ca['ttft_p90'] * 1e3:.0f} vs {rr['ttft_p90'] * 1e3:.0f} ms, "
            f"{'lower' if ca['ttft_p90'] < rr['ttft_p90'] else 'NOT lower'} "
            f"(each round, ms: {'; '.join(p90s)})"
        )


if __name__ == "__main__":
    main()
