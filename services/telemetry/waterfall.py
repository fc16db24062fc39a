"""Draw a trace as a waterfall: in the terminal (rich) or as a PNG (matplotlib)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from rich.table import Table
from rich.text import Text

from cachepoint.telemetry.store import SpanRow, Trace

# The attributes worth a glance in a waterfall row, by span name prefix.
KEY_ATTRS = {
    "POST /v1/messages": (
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.cache_read.input_tokens",
        "gen_ai.usage.output_tokens",
    ),
    "render": ("cachepoint.render.tokens", "cachepoint.cache.scope"),
    "route": (
        "cachepoint.route.policy",
        "cachepoint.route.replica",
        "cachepoint.route.matched_tokens",
    ),
    "admit": (
        "cachepoint.admit.engine_hit_tokens",
        "cachepoint.admit.entry_hit_tokens",
        "cachepoint.admit.queue_wait_s",
    ),
    "prefill": (
        "cachepoint.prefill.computed_tokens",
        "cachepoint.prefill.cached_tokens",
        "cachepoint.prefill.device",
    ),
    "publish": ("cachepoint.publish.blocks_stored", "cachepoint.publish.events"),
    "decode": ("gen_ai.usage.output_tokens",),
    "bill": ("cachepoint.cost_usd", "cachepoint.ledger.inserted"),
}


def walk(span: SpanRow, depth: int = 0) -> Iterator[tuple[int, SpanRow]]:
    yield depth, span
    for child in span.children:
        yield from walk(child, depth + 1)


def _attrs(span: SpanRow) -> str:
    keys = KEY_ATTRS.get(span.name, ())
    parts = []
    for k in keys:
        if k in span.attributes:
            v = span.attributes[k]
            v = f"{v:.4g}" if isinstance(v, float) else v
            label = (
                k.removeprefix("gen_ai.usage.") if k.startswith("gen_ai.") else k.rsplit(".")[-1]
            )
            parts.append(f"{label}={v}")
    return " ".join(parts)


def table(trace: Trace, width: int = 40) -> Table:
    t0 = trace.root.start_ns
    total = max(trace.root.end_ns - t0, 1)
    tbl = Table(title=f"trace of {trace.request_id} ({total / 1e6:.1f} ms)", show_lines=False)
    for col in ("span", "service", "start ms", "ms", "timeline", "key attributes"):
        tbl.add_column(col, no_wrap=col != "key attributes")
    for depth, s in walk(trace.root):
        a = int((s.start_ns - t0) / total * width)
        b = max(a + 1, int((s.end_ns - t0) / total * width))
        bar = Text(
            " " * a + "█" * (b - a) + " " * (width - b),
            style="red" if s.status == "ERROR" else "cyan",
        )
        tbl.add_row(
            "  " * depth + s.name,
            s.service.removeprefix("cachepoint-"),
            f"{(s.start_ns - t0) / 1e6:.1f}",
            f"{s.duration_ms:.1f}",
            bar,
            _attrs(s),
        )
    return tbl


def png(trace: Trace, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(walk(trace.root))
    t0 = trace.root.start_ns
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.2))
    colors = {"cachepoint-gateway": "#4C72B0", "cachepoint-replica": "#DD8452"}
    for i, (_, s) in enumerate(rows):
        start = (s.start_ns - t0) / 1e6
        ax.barh(
            i,
            max(s.duration_ms, 0.05),
            left=start,
            color="#C44E52" if s.status == "ERROR" else colors.get(s.service, "#55A868"),
        )
        ax.text(start, i, f" {s.duration_ms:.1f} ms  {_attrs(s)}", va="center", fontsize=7)
    ax.set_xlim(0, (trace.root.end_ns - t0) / 1e6 * 1.45)  # room for the labels
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["  " * d + s.name for d, s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the gateway received the request")
    ax.set_title(f"{trace.request_id}: gateway (blue), replica (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
