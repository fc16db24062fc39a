"""Read span files back and assemble traces (for `cachepoint traces`)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT_NAME = "POST /v1/messages"


@dataclass(slots=True)
class SpanRow:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: str
    service: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict[str, Any]
    children: list[SpanRow] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass(slots=True)
class Trace:
    root: SpanRow
    spans: list[SpanRow]

    @property
    def request_id(self) -> str:
        return str(self.root.attributes.get("cachepoint.request_id", ""))

    def find(self, name: str) -> SpanRow | None:
        return next((s for s in self.spans if s.name == name), None)

    @property
    def ttft_ms(self) -> float | None:
        """Root start to the first token (the replica's decode span starts there)."""
        decode = self.find("decode")
        return (decode.start_ns - self.root.start_ns) / 1e6 if decode else None

    @property
    def replica(self) -> str:
        route = self.find("route")
        return str(route.attributes.get("cachepoint.route.replica", "?")) if route else "?"


def load_spans(folder: Path) -> list[SpanRow]:
    rows: list[SpanRow] = []
    for path in sorted(folder.glob("spans-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                rows.append(
                    SpanRow(
                        r["trace_id"],
                        r["span_id"],
                        r["parent_id"],
                        r["name"],
                        r["kind"],
                        r["service"],
                        int(r["start_ns"]),
                        int(r["end_ns"]),
                        r["status"],
                        r.get("attributes", {}),
                    )
                )
    return rows


def assemble(rows: list[SpanRow]) -> list[Trace]:
    """Request traces (those with a gateway messages span), oldest first."""
    by_trace: dict[str, list[SpanRow]] = defaultdict(list)
    for r in rows:
        by_trace[r.trace_id].append(r)
    traces = []
    for spans in by_trace.values():
        ids = {s.span_id: s for s in spans}
        for s in spans:
            s.children.clear()
        for s in spans:
            if s.parent_id in ids:
                ids[s.parent_id].children.append(s)
        for s in spans:
            s.children.sort(key=lambda c: c.start_ns)
        root = next((s for s in spans if s.name == ROOT_NAME and s.parent_id not in ids), None)
        if root is not None:
            traces.append(Trace(root, sorted(spans, key=lambda s: s.start_ns)))
    return sorted(traces, key=lambda t: t.root.start_ns)


def load_traces(folder: Path) -> list[Trace]:
    return assemble(load_spans(folder))
