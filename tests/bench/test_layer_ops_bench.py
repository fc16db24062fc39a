"""bench/layer_ops_bench.py at small shapes: every step timed both ways and a saving
summed from the figures printed; bad arguments refused."""

from __future__ import annotations

import re

import pytest

from cachepoint.bench import layer_ops_bench as lob
from cachepoint.engine import cpu_kernels


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no CPU kernels here")
def test_every_step_is_timed_both_ways_and_the_total_adds_up(capsys) -> None:
    argv = ["--rows", "3,1", "--hidden", "64", "--intermediate", "96", "--layers", "2"]
    assert lob.main([*argv, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s*(\d+)  (.{24})  +([0-9.]+)  +([0-9.]+) .*?(-?[0-9.]+) ms$", out, re.M)
    steps = {name.strip() for _, name, *_ in rows}
    assert steps == {"rms_norm", "residual add + rms_norm", "rotary (q and k)", "silu(gate) * up"}
    assert len(rows) == 8 and all(float(t) > 0 and float(k) > 0 for _, _, t, k, _ in rows)
    totals = re.findall(r"^\s*(\d+)  all .*?(-?[0-9.]+) ms$", out, re.M)
    for count, total in totals:
        saved = sum(float(s) for r, _, _, _, s in rows if r == count)
        assert float(total) == pytest.approx(saved, abs=0.02)


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "x"], ["--head-dim", "63"]])
def test_bad_arguments_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        lob.main(argv)
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
