"""`cachepoint sim` without `--trace`: the bundled Mooncake sample, shipped as package data.

A plain clone (or an installed package) has no full trace beside it, so the default
must be in the package; full traces are taken by path, and the report refuses to run
its sweep on the sample unless the sample is named.
"""

from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from cachepoint.embedded.cli import main
from cachepoint.sim import cli as sim_cli
from cachepoint.sim.trace import load_trace

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bare_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with no traces/ and no $CACHEPOINT_TRACE: only the sample is left."""
    monkeypatch.delenv(sim_cli.TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_sample_is_a_small_mooncake_trace_next_to_the_module():
    sample = sim_cli.SAMPLE_TRACE
    assert sample.parent.parent == Path(sim_cli.__file__).resolve().parent
    assert sample.stat().st_size < 200_000
    trace = load_trace(sample)
    assert trace.format == "mooncake"
    assert trace.block_tokens == 512
    assert len(trace) == 500


def test_the_sample_is_package_data():
    # NOTE: setuptools installs only the package data pyproject.toml names; without
    # the entry an installed `cachepoint sim` would have no default trace at all.
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["cachepoint.sim"]
    rel = sim_cli.SAMPLE_TRACE.relative_to(Path(sim_cli.__file__).resolve().parent)
    assert any(fnmatch(rel.as_posix(), p) for p in patterns), patterns


def test_sim_without_trace_replays_the_sample(bare_cwd: Path, capsys):
    assert sim_cli.full_trace() is None
    rc = main(["sim", "--limit", "40", "--replicas", "2", "--json", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == str(sim_cli.SAMPLE_TRACE)
    assert out["requests"] == 40


def test_a_full_trace_by_env_or_in_traces_wins_over_the_sample(
    bare_cwd: Path, monkeypatch: pytest.MonkeyPatch, trace_file: Path, capsys
):
    (bare_cwd / "traces").mkdir()
    local = bare_cwd / "traces" / "conversation_trace.jsonl"
    local.write_bytes(trace_file.read_bytes())
    assert main(["sim", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"] == "traces/conversation_trace.jsonl"
    monkeypatch.setenv(sim_cli.TRACE_ENV, str(trace_file))
    assert main(["sim", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"] == str(trace_file)


def test_report_without_a_full_trace_is_a_usage_error(bare_cwd: Path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["sim", "report", "--out", str(bare_cwd / "out"), "--quick"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "the report needs a full trace: pass --trace FILE" in err
    assert not (bare_cwd / "out").exists()  # nothing was swept or written


def test_help_names_the_sample_as_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    assert "bundled sample" in " ".join(capsys.readouterr().out.split())
