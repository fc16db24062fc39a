"""bench/attention_bench.py on shapes small enough for a test: one row per case, the
two paths agreeing, and a clear exit where the kernel cannot run."""

from __future__ import annotations

import pytest

from cachepoint.bench import attention_bench as ab
from cachepoint.engine import cpu_kernels


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no CPU kernel here")
@pytest.mark.parametrize(("new", "cached"), [(40, 0), (9, 50)])
def test_a_case_is_one_row_whose_paths_agree(new: int, cached: int) -> None:
    row = ab.case(4, 2, 16, new, cached, repeats=1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["4/2", "16", str(new), str(cached)]
    torch_ms, kernel_ms = float(cells[4]), float(cells[5])
    assert torch_ms >= 0 and kernel_ms >= 0  # printed to 0.01 ms: a tiny case may be 0.00
    assert cells[6].endswith("x") and float(cells[6][:-1]) > 0
    assert float(cells[7]) < 1e-4  # the same attention, to float32 rounding


def test_without_the_kernel_it_says_why_and_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    monkeypatch.setattr(cpu_kernels, "why_unavailable", lambda: "no AVX-512 here")
    assert ab.main([]) == 2
    assert "no AVX-512 here" in capsys.readouterr().out
