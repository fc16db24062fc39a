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


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no CPU kernels here")
def test_forward_runs_the_model_both_ways_and_leaves_the_dispatch_as_it_was(capsys) -> None:
    supported = cpu_kernels.layer_ops_supported
    argv = ["--rows", "1", "--repeats", "1", "--forward", "40", "--model", "tiny", "--rounds", "2"]
    assert lob.main(argv) == 0
    assert cpu_kernels.layer_ops_supported is supported
    out = capsys.readouterr().out
    sides = re.findall(
        r"^  (kernels|torch's ops) +prefill s: (.*); decode ms a token: (.*)$", out, re.M
    )
    assert [side for side, _, _ in sides] == ["kernels", "torch's ops"]
    for _, prefill, decode in sides:
        assert len(prefill.split(", ")) == len(decode.split(", ")) == 2
        assert all(float(v) > 0 for v in prefill.split(", ") + decode.split(", "))


@pytest.mark.parametrize(
    "argv", [["--rows", "0"], ["--rows", "x"], ["--head-dim", "63"], ["--forward", "-1"]]
)
def test_bad_arguments_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        lob.main(argv)
    assert exc.value.code == 2
    assert "--" in capsys.readouterr().err
