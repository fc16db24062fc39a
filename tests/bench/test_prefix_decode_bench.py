"""bench/prefix_decode_bench.py on the random tiny model: both layouts of the shared
prefix decode and print a step time; bad sizes are refused."""

from __future__ import annotations

import re

import pytest

from cachepoint.bench import prefix_decode_bench as pdb


def test_both_layouts_decode_and_print_a_step_time(capsys) -> None:
    assert pdb.main(["--model", "tiny", "--prefix", "256", "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    times = re.findall(r"prefix in (one run|runs of 1 block): ([0-9.]+) ms a step", out)
    assert [name for name, _ in times] == ["one run", "runs of 1 block"]
    assert all(float(ms) > 0 for _, ms in times)


def test_one_lane_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        pdb.main(["--model", "tiny", "--lanes", "1"])
    assert exc.value.code == 2
    assert "--lanes" in capsys.readouterr().err
