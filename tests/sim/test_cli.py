"""`cachepoint sim`: JSON keys, human output, progress, and clear errors instead of tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachepoint.embedded.cli import main

ISSUE_KEYS = {
    "hit_ratio",
    "bound",
    "ratio_to_bound",
    "ttft_p50_s",
    "ttft_p90_s",
    "cost_saving",
    "elapsed_s",
}


def test_json_output_has_the_issue_keys(trace_file: Path, capsys: pytest.CaptureFixture[str]):
    rc = main(
        ["sim", "--trace", str(trace_file), "--replicas", "3", "--capacity-frac", "5%", "--json"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= ISSUE_KEYS
    assert out["replicas"] == 3
    assert 0.0 < out["bound"] < 1.0
    assert out["ratio_to_bound"] == pytest.approx(out["hit_ratio"] / out["bound"])
    assert out["policy"] == "cache_aware"  # what the product ships: the gateway's default
    assert out["eviction"] == "reuse_credit"  # and the replica's


def test_the_shipped_defaults_are_the_products_own():
    from cachepoint.gateway.settings import GatewaySettings
    from cachepoint.replica.settings import ReplicaSettings
    from cachepoint.sim.cli import SHIPPED_EVICTION, SHIPPED_POLICY

    assert GatewaySettings.model_fields["routing_policy"].default == SHIPPED_POLICY
    assert ReplicaSettings.model_fields["eviction"].default == SHIPPED_EVICTION


def test_progress_goes_to_stderr_and_json_stays_clean(trace_file: Path, capsys):
    rc = main(
        ["sim", "--trace", str(trace_file), "--policy", "round_robin", "--json", "--progress"]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["policy"] == "round_robin"
    assert "100%" in captured.err
    assert "requests" in captured.err


def test_human_output_names_the_figures(trace_file: Path, capsys):
    assert main(["sim", "--trace", str(trace_file), "--retention", "5m", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for word in ("hit ratio", "ratio to bound", "TTFT", "queueing", "imbalance", "saving"):
        assert word in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "trace file not found"),
        ("{not json\n", "not valid JSON"),
        ('{"timestamp": 0}\n', "missing field 'input_length'"),
        ("\n", "holds no requests"),
    ],
)
def test_bad_trace_gives_one_clear_line(tmp_path: Path, capsys, content: str | None, message: str):
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["sim", "--trace", str(path), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cachepoint sim: error:")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["--capacity-frac", "0"],
        ["--capacity-frac", "abc"],
        ["--replicas", "-2"],
        ["--policy", "random"],
        ["--time-scale", "0"],
    ],
)
def test_bad_options_are_usage_errors(trace_file: Path, capsys, args: list[str]):
    with pytest.raises(SystemExit) as info:
        main(["sim", "--trace", str(trace_file), *args])
    assert info.value.code == 2
    assert "usage: cachepoint sim" in capsys.readouterr().err


def test_block_size_that_does_not_divide_the_trace_is_an_error(trace_file: Path, capsys):
    assert main(["sim", "--trace", str(trace_file), "--block-size", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_help_lists_sim_and_demo_still_parses(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sim", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--capacity-frac" in text
    assert "report" in text
    assert main(["demo", "--blocks", "32"]) == 0
    assert "kvcore demo" in capsys.readouterr().out
