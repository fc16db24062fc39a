"""Small hand-built traces for the simulator tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cachepoint.sim.trace import Trace, parse_trace

BT = 4  # tokens per hash id in the hand-built traces


def cachepoint_lines(requests: list[dict[str, object]], block_tokens: int = BT) -> list[str]:
    header = {"format": "cachepoint-trace", "version": 1, "block_tokens": block_tokens}
    return [json.dumps(header)] + [json.dumps(r) for r in requests]


def tiny_trace(requests: list[dict[str, object]], block_tokens: int = BT) -> Trace:
    return parse_trace(cachepoint_lines(requests, block_tokens), source="tiny")


def sessions_trace(n_requests: int = 120, seed: int = 3) -> Trace:
    """Multi-turn sessions of a few tenants, each turn extending the previous prompt."""
    rng = random.Random(seed)
    next_id = 1000
    sessions: list[tuple[str, list[int]]] = []
    reqs: list[dict[str, object]] = []
    t = 0.0
    for _ in range(n_requests):
        t += rng.expovariate(2.0)
        if sessions and rng.random() < 0.6:
            tenant, ids = rng.choice(sessions)
        else:
            tenant, ids = rng.choice(["acme", "globex"]), [1, 2]  # a shared system prompt
            sessions.append((tenant, ids))
        grow = rng.randint(1, 4)
        ids.extend(range(next_id, next_id + grow))
        next_id += grow
        length = (len(ids) - 1) * BT + rng.randint(1, BT)
        reqs.append(
            {
                "timestamp": round(t * 1000),
                "input_length": length,
                "output_length": rng.randint(0, 6),
                "hash_ids": list(ids),
                "tenant": tenant,
            }
        )
    return tiny_trace(reqs)


@pytest.fixture
def sessions() -> Trace:
    return sessions_trace()


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(cachepoint_lines(_requests_for_file())) + "\n")
    return path


def _requests_for_file() -> list[dict[str, object]]:
    trace = sessions_trace(60, seed=5)
    return [
        {
            "timestamp": r.arrival_s * 1000,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
            "tenant": r.tenant,
        }
        for r in trace.requests
    ]
