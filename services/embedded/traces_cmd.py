"""`cachepoint traces`: recent requests from the local span files, or one as a waterfall."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cachepoint.telemetry.store import Trace, load_traces
from cachepoint.telemetry.waterfall import png, table


def add_traces_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "traces",
        help="list recent requests, or draw one request's trace as a waterfall",
        description=(
            "Reads the span files the embedded stack writes (STATE_DIR/traces). With no "
            "request id it lists recent requests; with one it draws that request's spans "
            "from the gateway through the replica, with durations and key attributes."
        ),
    )
    p.add_argument("request_id", nargs="?", help="a request-id response header value")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(".cachepoint/traces"),
        help="span folder (default ./.cachepoint/traces)",
    )
    p.add_argument("--limit", type=int, default=20, help="requests to list (default 20)")
    p.add_argument("--png", type=Path, metavar="FILE", help="also save the waterfall as a PNG")


def _list(traces: list[Trace], limit: int, console: Console) -> None:
    t = Table(title=f"{min(limit, len(traces))} most recent requests")
    for col in (
        "request id",
        "model",
        "input",
        "cache read",
        "cache write",
        "output",
        "TTFT ms",
        "replica",
    ):
        t.add_column(col, no_wrap=True)
    for tr in traces[-limit:]:
        a = tr.root.attributes
        ttft = tr.ttft_ms
        t.add_row(
            tr.request_id,
            str(a.get("gen_ai.request.model", "?")),
            str(a.get("cachepoint.usage.input_tokens", "-")),
            str(a.get("gen_ai.usage.cache_read.input_tokens", "-")),
            str(a.get("gen_ai.usage.cache_creation.input_tokens", "-")),
            str(a.get("gen_ai.usage.output_tokens", "-")),
            f"{ttft:.1f}" if ttft is not None else "-",
            tr.replica,
        )
    console.print(t)


def show(
    folder: Path,
    request_id: str,
    console: Console,
    png_path: Path | None = None,
    wait_s: float = 0.0,
) -> bool:
    """Draw one request's waterfall; waits up to ``wait_s`` for its spans to be flushed."""
    deadline = time.time() + wait_s
    while True:
        found = next((t for t in load_traces(folder) if t.request_id == request_id), None)
        complete = found is not None and found.find("bill") is not None
        if complete or time.time() >= deadline:
            break
        time.sleep(0.2)
    if found is None:
        return False
    console.print(table(found))
    if png_path is not None:
        console.print(f"waterfall saved to {png(found, png_path)}")
    return True


def run_traces(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    console = Console(width=None if Console().is_terminal else 160)
    if not args.dir.is_dir():
        parser.error(f"no span folder at {args.dir}; start the stack with `cachepoint up`")
    if args.request_id:
        if not show(args.dir, args.request_id, console, args.png):
            console.print(f"[red]no trace for {args.request_id} in {args.dir}[/red]")
            return 1
        return 0
    traces = load_traces(args.dir)
    if not traces:
        console.print(f"no requests traced in {args.dir} yet")
        return 0
    _list(traces, args.limit, console)
    return 0
