"""`cachepoint sim report` writes every plot and a summary built from its own runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cachepoint.embedded.cli import main
from cachepoint.sim.report import LINES, PLOTS, Sweep, grid_labels, parse_label, write_report

SMALL = Sweep(
    None,
    (2, 4),
    (0.1, 0.2),
    (1.0, 0.5),
    headline_replicas=4,
    headline_fracs=(0.2, 0.1),
    tier_points=((0.1, 0.2),),
    grid_policies=("round_robin", "cache_aware"),
    grid_evictions=("lru", "slru"),
    host_fracs=(0.1, 0.2),
    disk_points=((0.1, 0.1, 0.2),),
)


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
    assert {r["line"] for r in runs} == {line.label for line in LINES} | set(grid_labels(SMALL))
    assert all(0.0 <= r["hit_ratio"] <= r["bound"] + 1e-9 for r in runs)
    assert {r["retention"] for r in runs} == {"none", "5m", "1h"}
    assert {r["time_scale"] for r in runs if r["replicas"] == 4} == {1.0, 0.5}
    pooled = [r for r in runs if r["replicas"] == 1]  # the fleet's capacity in one pool
    assert {r["time_scale"] for r in pooled} == {4.0}
    assert "One pool holding the whole fleet's capacity" in summary


def test_report_runs_every_routing_eviction_and_tier_size(trace_file: Path, tmp_path: Path):
    out = tmp_path / "report"
    assert write_report(str(trace_file), out, jobs=1, sweep=SMALL) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    keys = [(r["line"], r["replicas"], r["frac"], r["host"], r["disk"]) for r in runs]
    for label in grid_labels(SMALL):
        assert (label, 4, 0.1, 0.0, 0.0) in keys  # device-only
        assert (label, 4, 0.1, 0.2, 0.0) in keys  # with the host tier
    for label in SMALL.curve_lines:
        for dev in SMALL.headline_fracs:
            for host in SMALL.host_fracs:
                assert (label, 4, dev, host, 0.0) in keys  # the host-size curve
    configs = [
        (*k, r["seed"], r["retention"], r["time_scale"]) for k, r in zip(keys, runs, strict=True)
    ]
    assert len(configs) == len(set(configs))  # the grid's overlap with the lines runs once
    tiered = [r for r in runs if r["host"] > 0]
    assert all(r["host_slots"] > 0 and "host" in r["tiers"] for r in tiered)
    assert any(r["disk"] > 0 and r["tiers"]["disk"]["demotions"] > 0 for r in runs)
    summary = (out / "summary.md").read_text()
    assert "## KV tiers (issue 16)" in summary
    assert "### Every routing x eviction, with and without the host tier" in summary
    for label in grid_labels(SMALL):
        assert f"| {label} |" in summary or f"**{label}**" in summary
    assert (out / "hit_ratio_vs_host.png").read_bytes().startswith(b"\x89PNG")


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


def test_labels_name_routing_options_and_eviction():
    assert parse_label("cache_aware + lru") == ("cache_aware", {}, "lru")
    assert parse_label("cache_aware:load_weight=0.1 + reuse_credit") == (
        "cache_aware",
        {"load_weight": 0.1},
        "reuse_credit",
    )
    for bad in ("cache_aware", "cache_aware:load_weight + lru", "x:w=heavy + lru"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_label(bad)
