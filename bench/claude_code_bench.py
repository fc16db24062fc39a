"""Claude Code on the embedded stack: a 5-turn session, and what each turn cost.

Run:  .venv/bin/python bench/claude_code_bench.py [--turns 5] [--random-turn-tokens 64]

Starts the embedded stack (`cachepoint up`'s: one replica of the tiny model with
SmolLM2's tokenizer and a 262,144-token window), then runs Claude Code 2.1.328 from
`make clients` with a fresh HOME in an empty project: `claude -p` once, then
`claude -p --continue` for every further turn. Per turn it prints the server-side time
to first token (the replica's queue + prefill for the turn's main request), the wall
time of the claude call, the four usage buckets from the ledger, and the cost against
the same requests with no caching (cachepoint.billing's price math).

Targets: from turn 2 on, at least 90% of each turn's input read from the
cache; the session at least 80% cheaper than uncached. Exits 1 when a claude call fails
(its error is printed) or a target is missed.

NOTE: a cold session cannot meet the cost target: its first turn writes the whole
prompt at 1.25x, and each later turn reads it at 0.1x, so five turns cost at least
(1.25 + 4 x 0.1) / 5 = 33% of uncached (67% saved). Claude Code's tools are the same
for every session of an org, and its system text for every session in one project
(it names the working directory), so a session on a gateway that has served one
before reads them on its first turn. The bench runs --sessions sessions (default 3)
one after the other: a cold one, warm ones each in a new project, and the last one in
the first session's project (a developer's next session in the same repository); the
cost target is judged on the warm ones, every session is printed.

NOTE: the tiny model's random weights never write an end-of-turn token; the stack ends
each of its turns at --random-turn-tokens (as `cachepoint up` does, default 64), so
Claude Code runs unmodified (its own max_tokens 32,000, no --model: the stack's
"claude-*" alias serves its default Claude model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text

# NOTE: the environment a user sets for Claude Code is the client tests' own (the same
# function), so the bench runs the CLI exactly as they do.
from cachepoint.bench.clients import claude_env
from cachepoint.billing import Buckets, Price, cost_micros, uncached_cost_micros
from cachepoint.embedded.stack import Stack, free_port
from cachepoint.gateway.billing.ledger import price_for
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.random_model import RANDOM_CONTEXT

ROOT = Path(__file__).resolve().parents[1]

CLAUDE = ROOT / ".tools" / "node" / "node_modules" / ".bin" / "claude"
PROMPTS = [
    "say hi",
    "what files are in this project?",
    "summarise README.md in one line",
    "suggest a better title for it",
    "thanks, that is all",
]


@dataclass(frozen=True, slots=True)
class Turn:
    """One claude call: its main request's ledger row, timings and costs."""

    n: int  # 1-based turn number
    requests: int  # ledger rows the call added (the main request and any side ones)
    buckets: Buckets  # the main request's four buckets and its output
    ttft_s: float | None  # the replica's queue + prefill for the main request
    wall_s: float  # the whole claude call, start to exit
    cost_micros: int  # every row the turn added, as billed
    uncached_micros: int  # the same rows with no caching

    @property
    def read_share(self) -> float:
        p = self.buckets.prompt_tokens
        return self.buckets.cache_read_input_tokens / p if p else 0.0


def ledger_rows(db_url: str) -> list[tuple[str, str, Buckets]]:
    """(request id, served model, buckets) per usage row, oldest first."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            q = (
                "SELECT request_id, model, input_tokens, cache_read_input_tokens,"
                " cache_write_5m_tokens, cache_write_1h_tokens, output_tokens"
                " FROM usage ORDER BY rowid"
            )
            return [(r[0], r[1], Buckets(*r[2:])) for r in conn.execute(text(q))]
    finally:
        engine.dispose()


def prices(db_url: str, models: set[str]) -> dict[str, Price]:
    """Each model's price as the gateway bills it (a price row, else its defaults)."""
    s = GatewaySettings()
    default = Price(s.default_input_per_mtok, s.default_output_per_mtok)
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            return {m: price_for(session, m, default) for m in models}
    finally:
        engine.dispose()


def replica_timings(logs: Path) -> dict[str, float]:
    """request id -> queue_s + prefill_s, from the replicas' JSON request lines."""
    out: dict[str, float] = {}
    for log in logs.glob("replica-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.get("logger") == "cachepoint.replica.requests" and "prefill_s" in rec:
                out[rec["request_id"]] = rec.get("queue_s", 0.0) + rec["prefill_s"]
    return out


def run_session(
    base_url: str, api_key: str, db_url: str, logs: Path, turns: int, work: Path | None = None
) -> list[Turn]:
    """One Claude Code session of ``turns`` calls: a new session (``claude -p`` first)
    in ``work``'s HOME and project, a fresh pair when ``work`` is None."""
    if work is None or not (work / "project").is_dir():
        work = work or Path(tempfile.mkdtemp(prefix="cc-bench-"))
        (work / "home").mkdir(parents=True)
        (work / "project").mkdir()
        (work / "project" / "README.md").write_text(
            "# notes\nA scratch project for the Claude Code bench.\n"
        )
    home, project = work / "home", work / "project"
    env = claude_env(base_url, api_key, home, RANDOM_CONTEXT)
    out: list[Turn] = []
    seen = len(ledger_rows(db_url))
    for i in range(turns):
        args = [str(CLAUDE), "-p", PROMPTS[i % len(PROMPTS)]]
        if i:
            args.insert(1, "--continue")
        t0 = time.monotonic()
        r = subprocess.run(
            args, cwd=project, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        wall = time.monotonic() - t0
        if r.returncode != 0:
            sys.exit(f"turn {i + 1}: claude exited {r.returncode}: {r.stdout}{r.stderr}")
        rows = ledger_rows(db_url)
        new, seen = rows[seen:], len(rows)
        if not new:
            sys.exit(f"turn {i + 1}: nothing was billed")
        price = prices(db_url, {m for _, m, _ in new})
        rid, _, main = max(new, key=lambda row: row[2].prompt_tokens)
        out.append(
            Turn(
                n=i + 1,
                requests=len(new),
                buckets=main,
                ttft_s=replica_timings(logs).get(rid),
                wall_s=wall,
                cost_micros=sum(cost_micros(b, price[m]) for _, m, b in new),
                uncached_micros=sum(uncached_cost_micros(b, price[m]) for _, m, b in new),
            )
        )
    return out


def report(turns: list[Turn], judge_cost: bool) -> bool:
    """Print the turns and whether they meet the targets (the cost one if ``judge_cost``)."""
    print(
        f"{'turn':>4} {'reqs':>4} {'ttft_s':>7} {'wall_s':>7} {'input':>7} {'read':>7} "
        f"{'write5m':>7} {'write1h':>7} {'output':>6} {'read%':>6} {'cost$':>9} {'uncached$':>9}"
    )
    for t in turns:
        b = t.buckets
        ttft = f"{t.ttft_s:7.3f}" if t.ttft_s is not None else f"{'?':>7}"
        print(
            f"{t.n:>4} {t.requests:>4} {ttft} {t.wall_s:7.1f} {b.input_tokens:>7} "
            f"{b.cache_read_input_tokens:>7} {b.cache_write_5m_tokens:>7} "
            f"{b.cache_write_1h_tokens:>7} {b.output_tokens:>6} {t.read_share:6.1%} "
            f"{t.cost_micros / 1e6:9.5f} {t.uncached_micros / 1e6:9.5f}"
        )
    cost = sum(t.cost_micros for t in turns)
    uncached = sum(t.uncached_micros for t in turns)
    saved = 1 - cost / uncached if uncached else 0.0
    print(f"session: ${cost / 1e6:.5f} against ${uncached / 1e6:.5f} uncached: {saved:.1%} saved")
    reads_ok = all(t.read_share >= 0.9 for t in turns[1:])
    print(f"target: turns 2+ read >= 90% of input: {'met' if reads_ok else 'MISSED'}")
    cost_ok = saved >= 0.8
    verdict = ("met" if cost_ok else "MISSED") if judge_cost else "not judged (cold session)"
    print(f"target: session >= 80% cheaper than uncached: {verdict}")
    return reads_ok and (cost_ok or not judge_cost)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument(
        "--sessions",
        type=int,
        default=3,
        help="the first is cold; with 3 or more the last runs in the first one's project",
    )
    ap.add_argument(
        "--random-turn-tokens", type=int, default=64, help="the tiny model's turn length"
    )
    args = ap.parse_args()
    if not CLAUDE.exists():
        sys.exit(f"{CLAUDE} is missing: run `make clients`")
    state = Path(tempfile.mkdtemp(prefix="cc-bench-state-"))
    stack = Stack(
        state,
        replicas=1,
        port=free_port(),
        tracing=False,
        random_turn_tokens=args.random_turn_tokens,
    )
    stack.start(progress=lambda m: print(f"  {m}", file=sys.stderr))
    ok = True
    try:
        first = Path(tempfile.mkdtemp(prefix="cc-bench-"))
        for n in range(args.sessions):
            # NOTE: the last warm session is a developer's next one in the first
            # session's project (same HOME, a new `claude -p`); the others each get a
            # project of their own, whose working directory is in the system text.
            same = n > 0 and n == args.sessions - 1 and args.sessions > 2
            turns = run_session(
                stack.base_url,
                stack.keys["api_key"],
                stack.db_url,
                state / "logs",
                args.turns,
                first if n == 0 or same else None,
            )
            where = "the first session's project" if same else "a new project"
            print(f"session {n + 1} ({'cold' if n == 0 else 'warm'} gateway, {where})")
            ok = report(turns, judge_cost=n > 0) and ok
    finally:
        stack.stop()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
