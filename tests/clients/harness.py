"""The real npm clients as the tests run them: where `make clients` put
them, a hermetic environment for Claude Code, and readers for what the gateway wrote
(its JSON request log, its ledger)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

# NOTE: claude_env is shared with bench/claude_code_bench.py, so it lives in the bench
# package; re-exported here for the client tests.
from cachepoint.bench.clients import claude_env as claude_env
from cachepoint.billing import Buckets
from cachepoint.gateway.db.session import make_engine

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = ROOT / ".tools" / "node" / "node_modules"
CLAUDE = NODE_MODULES / ".bin" / "claude"
CLAUDE_VERSION = "2.1.328"
TS_SDK = NODE_MODULES / "@anthropic-ai" / "sdk"
TS_CHECK = Path(__file__).resolve().parent / "ts_sdk_check.mjs"

# NOTE: random weights never end a turn by themselves; the stack ends each of the
# tiny model's turns at this many tokens (`cachepoint up --random-turn-tokens`,
# default 64), so Claude Code gets end_turn answers to its max_tokens 32,000 requests
# without being told anything.
RANDOM_TURN_TOKENS = 64


def installed(path: Path) -> Path:
    """``path`` if `make clients` installed it; a failure (never a skip) otherwise."""
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make clients` (npm ci into .tools/node)")
    return path


def run_claude(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(installed(CLAUDE)), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def transcript_sessions(home: Path) -> set[str]:
    """The session ids Claude Code saved under HOME (one transcript file per session)."""
    return {p.stem for p in (home / ".claude" / "projects").glob("*/*.jsonl")}


def request_log(logs: Path) -> list[dict[str, Any]]:
    """The gateway's one-JSON-line-per-request log (logger ``cachepoint.requests``)."""
    out = []
    for line in (logs / "gateway.log").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("logger") == "cachepoint.requests":
                out.append(rec)
    return out


@dataclass(frozen=True, slots=True)
class Row:
    """One ledger row, in the order it was billed."""

    request_id: str  # the gateway's request id
    session_id: str | None  # X-Claude-Code-Session-Id as billed
    buckets: Buckets  # the four input buckets and the output, as billed
    cost_micros: int  # what the row was billed, micro-dollars

    @property
    def prompt_tokens(self) -> int:
        return self.buckets.prompt_tokens

    @property
    def read_share(self) -> float:
        p = self.prompt_tokens
        return self.buckets.cache_read_input_tokens / p if p else 0.0


def ledger(db_url: str) -> list[Row]:
    """Every usage row, oldest first (SQLite's rowid is the insertion order)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            q = (
                "SELECT request_id, session_id, input_tokens, cache_read_input_tokens,"
                " cache_write_5m_tokens, cache_write_1h_tokens, output_tokens, cost_micros"
                " FROM usage ORDER BY rowid"
            )
            return [Row(r[0], r[1], Buckets(*r[2:7]), r[7]) for r in conn.execute(text(q))]
    finally:
        engine.dispose()


def miss_of(db_url: str, request_id: str) -> tuple[str | None, int | None]:
    """A usage row's cache diagnostics: (miss_reason, miss_tokens)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            q = text("SELECT miss_reason, miss_tokens FROM usage WHERE request_id = :rid")
            row = conn.execute(q, {"rid": request_id}).one()
            return row[0], row[1]
    finally:
        engine.dispose()
