"""A span exporter for one machine: JSON lines under a folder, one file per process.

The embedded stack writes here and `cachepoint traces` reads it back; in a cluster
the OTLP exporter sends to the collector instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_encode = msgspec.json.Encoder(enc_hook=str).encode


def span_record(span: ReadableSpan) -> dict[str, object]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": str(span.resource.attributes.get("service.name", "")),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
    }


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, folder: Path, service: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"spans-{service}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        # NOTE: msgspec, not json: the export thread holds the GIL while it encodes,
        # and on a small machine that time comes straight out of request handling.
        data = b"".join(_encode(span_record(s)) + b"\n" for s in spans)
        with self._lock, open(self.path, "ab") as f:
            f.write(data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open between exports."""
