"""The engine's linear: oneDNN for large CPU weights, our kernel for a few rows,
F.linear otherwise; the same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cachepoint.engine import cpu_kernels
from cachepoint.engine import linear as lin


@pytest.mark.skipif(not lin.USE_ONEDNN, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [0, 1, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("intel", [False, True])
def test_large_weights_go_to_onednn_and_agree_with_f_linear(
    monkeypatch: pytest.MonkeyPatch, rows: int, bias: bool, intel: bool
) -> None:
    """Large weights go to oneDNN, except a single row on an Intel CPU (MKL's sgemv
    streams faster there) and a decode batch's few rows (small_matmul); whichever
    runs, the product is F.linear's."""
    monkeypatch.setattr(lin, "MKL_FOR_ONE_ROW", intel)
    calls = {"n": 0}
    onednn = lin._ONEDNN

    def counted(*args: object) -> torch.Tensor:
        calls["n"] += 1
        assert onednn is not None
        return onednn(*args)

    monkeypatch.setattr(lin, "_ONEDNN", counted)
    torch.manual_seed(rows)
    weight = torch.randn(1024, 576)  # 589,824 weights: over the line
    assert weight.numel() >= lin.ONEDNN_MIN_WEIGHTS
    b = torch.randn(1024) if bias else None
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        got = lin.linear(x, weight, b)
        want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    # MKL, or our own kernel where this CPU can run it (AVX512; an AVX2 CPU does not)
    ours = rows in lin.SMALL_ROWS and cpu_kernels.small_matmul_supported()
    elsewhere = (intel and rows == 1) or ours
    assert calls["n"] == (0 if elsewhere else 1)
    assert got.shape == (rows, 1024) and got.dtype == torch.float32
    if rows:  # float32 rounding of a 576-term sum, in another order than MKL's
        assert (got.double() - want).abs().max().item() <= 1e-3


def test_small_weights_other_dtypes_and_devices_take_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("oneDNN was called")

    monkeypatch.setattr(lin, "_ONEDNN", refuse)
    small = torch.randn(128, 64)
    x = torch.randn(3, 64)
    assert torch.equal(lin.linear(x, small), F.linear(x, small))
    big = torch.randn(1024, 576, dtype=torch.float64)  # a dtype oneDNN is not given
    xd = torch.randn(2, 576, dtype=torch.float64)
    assert torch.equal(lin.linear(xd, big), F.linear(xd, big))
    mixed = torch.randn(1024, 576)
    with pytest.raises(RuntimeError):  # mismatched dtypes: F.linear's own error
        lin.linear(torch.randn(2, 576, dtype=torch.bfloat16), mixed)


@pytest.mark.skipif(not lin.USE_ONEDNN, reason="this torch build has no oneDNN linear")
def test_bfloat16_on_onednn_matches_f_linear() -> None:
    torch.manual_seed(1)
    weight = torch.randn(1024, 576).bfloat16()
    x = torch.randn(4, 576).bfloat16()
    got = lin.linear(x, weight).float()
    want = F.linear(x.float(), weight.float())
    assert (got - want).abs().max().item() <= 0.25  # bf16 output rounding at |y| ~ 24


def test_the_vendor_is_read_from_cpuinfo() -> None:
    vendor = lin.cpu_vendor()
    with open("/proc/cpuinfo") as f:
        assert f"vendor_id\t: {vendor}" in f.read()
    assert (vendor == "GenuineIntel") == lin.MKL_FOR_ONE_ROW
