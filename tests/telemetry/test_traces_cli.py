"""`cachepoint traces` over span files written by the file exporter."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry import trace

from cachepoint.telemetry import TelemetrySettings, configure
from cachepoint.telemetry.store import load_traces


def _write_trace(folder, rid: str = "req_abc") -> None:
    settings = TelemetrySettings(exporter="file", traces_dir=folder)
    gw = configure("cachepoint-gateway", settings)
    rep = configure("cachepoint-replica", settings)
    with gw.tracer.start_as_current_span("POST /v1/messages") as root:
        root.set_attributes(
            {
                "cachepoint.request_id": rid,
                "gen_ai.request.model": "m",
                "gen_ai.usage.output_tokens": 3,
                "cachepoint.usage.input_tokens": 7,
            }
        )
        with gw.tracer.start_as_current_span("route") as route:
            route.set_attribute("cachepoint.route.replica", "r0")
        ctx = trace.set_span_in_context(root)
        with rep.tracer.start_as_current_span("POST /v1/generate", context=ctx):
            with rep.tracer.start_as_current_span("prefill") as p:
                p.set_attribute("cachepoint.prefill.computed_tokens", 12)
            with rep.tracer.start_as_current_span("decode"):
                pass
        with gw.tracer.start_as_current_span("bill"):
            pass
    gw.shutdown()
    rep.shutdown()


def test_traces_store_assembles_the_tree(tmp_path):
    _write_trace(tmp_path)
    (tr,) = load_traces(tmp_path)
    assert tr.request_id == "req_abc"
    assert [c.name for c in tr.root.children] == ["route", "POST /v1/generate", "bill"]
    assert tr.replica == "r0"
    assert tr.ttft_ms is not None and tr.ttft_ms >= 0


def test_traces_cli_lists_draws_and_saves_png(tmp_path):
    _write_trace(tmp_path)
    cmd = [sys.executable, "-m", "cachepoint.embedded.cli", "traces", "--dir", str(tmp_path)]
    listing = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "req_abc" in listing and "r0" in listing
    png = tmp_path / "wf.png"
    out = subprocess.run(
        [*cmd, "req_abc", "--png", str(png)], capture_output=True, text=True, check=True
    ).stdout
    assert "prefill" in out and "computed_tokens=12" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([*cmd, "req_nope"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no trace for req_nope" in missing.stdout
