"""`cachepoint up --demo`: an agent-style session through the official anthropic SDK.

A tool list and a long static system prompt marked ``global``, a short dynamic
system tail, then turns with tool_use / tool_result blocks where only the last
message carries the breakpoint, the way coding agents use prompt caching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anthropic
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cachepoint.billing import Price, buckets, cost_micros, uncached_cost_micros

MODEL = "cachepoint-tiny"
SCOPE_BETA = "prompt-caching-scope-2026-01-05"

TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file from the repository and return its contents.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "repository path"}},
            "required": ["path"],
        },
    },
    {
        "name": "run_tests",
        "description": "Run the test suite, optionally filtered by a keyword expression.",
        "input_schema": {
            "type": "object",
            "properties": {"keyword": {"type": "string"}},
        },
    },
]

STATIC_SYSTEM = (
    "You are a careful software engineering agent working in a Python repository. "
    "Read before you write, keep changes small, run the tests after every change, and "
    "explain what you did in plain words. Never invent file contents; use the tools. "
) * 8

FILES = [
    "services/kvcore/pool.py",
    "gateway/app.py",
    "tests/kvcore/test_pool.py",
    "services/replica/scheduler.py",
    "docs/kvcore.md",
    "Makefile",
]


@dataclass(slots=True)
class Turn:
    n: int
    replica: str
    input_tokens: int
    cache_read: int
    cache_write_5m: int
    cache_write_1h: int
    output_tokens: int
    cost_micros: int
    uncached_micros: int
    ttft_s: float
    request_id: str
    reply: str = ""  # the model's text (the first text block), shown in the report


MAX_TOKENS = 24


def system_blocks() -> list[dict[str, Any]]:
    """The long static prompt, shared across tenants (global, 1h), then a dynamic tail."""
    return [
        {
            "type": "text",
            "text": STATIC_SYSTEM,
            "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"},
        },
        {"type": "text", "text": f"Session started {time.strftime('%Y-%m-%d %H:%M')}; user: demo."},
    ]


def user_turn(i: int, tool_id: str | None) -> dict[str, Any]:
    """Turn i's user message: the last tool's result, then the next instruction."""
    blocks: list[dict[str, Any]] = []
    if tool_id is not None:
        path = FILES[i % len(FILES)]
        blocks.append(
            {
                "type": "tool_result",
                "tool_use_id": tool_id,
                "content": f"# {path}\n" + f"def function_{i}(x):\n    return x * {i}\n" * 3,
            }
        )
    blocks.append({"type": "text", "text": f"Step {i}: look at the next file and report."})
    return {"role": "user", "content": blocks}


def assistant_turn(i: int, text: str) -> tuple[dict[str, Any], str]:
    """The assistant's reply: its text, then a tool call; returns the call's id too."""
    tool_id = f"toolu_{i:04d}"
    message = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": text or "Reading the next file."},
            {
                "type": "tool_use",
                "id": tool_id,
                "name": "read_file",
                "input": {"path": FILES[(i + 1) % len(FILES)]},
            },
        ],
    }
    return message, tool_id


def next_request(messages: list[dict[str, Any]], i: int, tool_id: str | None) -> None:
    """Append turn i's user message; only the last message carries the breakpoint."""
    strip_breakpoints(messages)
    msg = user_turn(i, tool_id)
    msg["content"][-1]["cache_control"] = {"type": "ephemeral"}
    messages.append(msg)


def strip_breakpoints(messages: list[dict[str, Any]]) -> None:
    for m in messages:
        if isinstance(m["content"], list):
            for b in m["content"]:
                b.pop("cache_control", None)


def run_session(
    base_url: str,
    api_key: str,
    turns: int = 12,
    console: Console | None = None,
    model: str = MODEL,
) -> list[Turn]:
    console = console or Console()
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=2)
    price = Price(3_000_000, 15_000_000)  # the gateway's default price table
    system = system_blocks()
    messages: list[dict[str, Any]] = []
    results: list[Turn] = []
    tool_id: str | None = None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("agent session", total=turns)
        for i in range(1, turns + 1):
            next_request(messages, i, tool_id)
            t0 = time.perf_counter()
            ttft = 0.0
            with client.messages.stream(
                model=model,
                max_tokens=MAX_TOKENS,
                tools=TOOLS,
                system=system,
                messages=messages,
                extra_headers={"anthropic-beta": SCOPE_BETA},
            ) as stream:
                for event in stream:
                    if event.type == "message_start" and not ttft:
                        ttft = time.perf_counter() - t0
                final = stream.get_final_message()
                replica = stream.response.headers.get("cachepoint-replica", "?")
                request_id = stream.response.headers.get("request-id", "")
            u = final.usage
            cc = u.cache_creation
            w5 = cc.ephemeral_5m_input_tokens if cc else 0
            w1 = cc.ephemeral_1h_input_tokens if cc else 0
            b = buckets(
                u.input_tokens + u.cache_read_input_tokens + w5 + w1,
                u.cache_read_input_tokens,
                w5,
                w1,
                u.output_tokens,
            )
            results.append(
                Turn(
                    i,
                    replica,
                    u.input_tokens,
                    u.cache_read_input_tokens,
                    w5,
                    w1,
                    u.output_tokens,
                    cost_micros(b, price),
                    uncached_cost_micros(b, price),
                    ttft,
                    request_id,
                )
            )
            # NOTE: a real model may answer with a tool_use block first (or only).
            text = next((b.text for b in final.content if b.type == "text"), "")
            results[-1].reply = text
            reply, tool_id = assistant_turn(i, text)
            messages.append(reply)
            progress.advance(task)
    return results


def print_report(turns: list[Turn], console: Console, replies: bool = False) -> None:
    """The per-turn table and the saving; with ``replies``, each turn's answer first
    (a real model's; the tiny random model's text is noise)."""
    if replies:
        for r in turns:
            console.print(f"turn {r.n}: {r.reply.strip()!r}", markup=False, highlight=False)
    t = Table(title="agent session through the gateway")
    for col in (
        "turn",
        "replica",
        "input",
        "cache read",
        "write 5m",
        "write 1h",
        "output",
        "cost $",
        "uncached $",
        "TTFT ms",
    ):
        t.add_column(col, justify="right")
    for r in turns:
        t.add_row(
            str(r.n),
            r.replica,
            str(r.input_tokens),
            str(r.cache_read),
            str(r.cache_write_5m),
            str(r.cache_write_1h),
            str(r.output_tokens),
            f"{r.cost_micros / 1e6:.6f}",
            f"{r.uncached_micros / 1e6:.6f}",
            f"{r.ttft_s * 1e3:.1f}",
        )
    console.print(t)
    cost = sum(r.cost_micros for r in turns)
    plain = sum(r.uncached_micros for r in turns)
    saving = 1 - cost / plain if plain else 0.0
    console.print(
        f"total: ${cost / 1e6:.6f} with caching vs ${plain / 1e6:.6f} without "
        f"— [bold]{saving:.1%} saved[/bold]"
    )
