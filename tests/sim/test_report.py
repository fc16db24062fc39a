"""`cachepoint sim report` writes every plot and a summary built from its own runs."""

from __future__ import annotations

import json
from pathlib import Path

from cachepoint.cli import main
from cachepoint.sim.report import LINES, PLOTS, Sweep, write_report

SMALL = Sweep(None, (2, 4), (0.1, 0.2), (1.0, 0.5), headline_replicas=4, headline_fracs=(0.2, 0.1))


def test_report_writes_plots_summary_and_results(trace_file: Path, tmp_path: Path, capsys):
    out = tmp_path / "report"
    assert write_report(str(trace_file), out, jobs=1, sweep=SMALL) == 0
    for name in PLOTS:
        assert (out / name).read_bytes().startswith(b"\x89PNG"), name
    summary = (out / "summary.md").read_text()
    assert "## Headline: 4 replicas" in summary
    assert "n/a" not in summary  # every run served requests
    for line in LINES:
        assert line.label in summary
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert results["meta"]["sweep"] == "custom"
    assert {r["line"] for r in runs} == {line.label for line in LINES}
    assert all(0.0 <= r["hit_ratio"] <= r["bound"] + 1e-9 for r in runs)
    assert {r["retention"] for r in runs} == {"none", "5m", "1h"}
    assert {r["time_scale"] for r in runs if r["replicas"] == 4} == {1.0, 0.5}
    pooled = [r for r in runs if r["replicas"] == 1]  # the fleet's capacity in one pool
    assert {r["time_scale"] for r in pooled} == {4.0}
    assert "One pool holding the whole fleet's capacity" in summary


def test_cli_report_quick_runs_end_to_end(trace_file: Path, tmp_path: Path, capsys):
    out = tmp_path / "quick"
    args = [
        "sim",
        "report",
        "--trace",
        str(trace_file),
        "--out",
        str(out),
        "--quick",
        "--jobs",
        "1",
    ]
    assert main(args) == 0
    assert (out / "summary.md").read_text().startswith("# Trace simulator: results")
    assert "wrote" in capsys.readouterr().out
