"""The elementwise layer kernels (csrc/layer_ops.cpp) against torch's own ops, their
input checks, and the dispatch in engine/layer_ops.py (kernel or torch fallback).

On a machine that can use the kernels (Linux, AVX-512: this project's CI machines)
they must build: a test here fails, rather than skips, when they do not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.engine import cpu_kernels, layer_ops
from cachepoint.engine.rotary import apply_rotary

pytestmark = pytest.mark.skipif(
    cpu_kernels.why_unavailable() is not None,
    reason=f"CPU kernel not usable here: {cpu_kernels.why_unavailable()}",
)


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),
    width=st.sampled_from([1, 15, 16, 17, 64, 576, 1000]),
    pad=st.sampled_from([0, 5]),
)
def test_rms_norm_equals_float64(rows: int, width: int, pad: int) -> None:
    g = torch.Generator().manual_seed(rows * 7919 + width)
    # Rows `pad` values apart beyond their width: a view, as a slice of a wider buffer.
    x = torch.randn(rows, width + pad, generator=g)[:, :width] * 3
    w = torch.randn(width, generator=g)
    got = cpu_kernels.rms_norm(x, w, 1e-5)
    assert got.shape == (rows, width) and got.is_contiguous()
    torch.testing.assert_close(got, rms_reference(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), w, 1e-5), rtol=2e-6, atol=2e-6)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), width=st.sampled_from([3, 16, 33, 576]))
def test_add_rms_norm_updates_the_residual_and_normalises_the_sum(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * 31 + width)
    residual = torch.randn(rows, width, generator=g)
    delta = torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    expected_sum = residual + delta
    got = cpu_kernels.add_rms_norm_(residual, delta, w, 1e-6)
    # The same float32 additions torch makes: the residual stream is bit-identical.
    assert torch.equal(residual, expected_sum)
    torch.testing.assert_close(got, rms_reference(expected_sum, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dim", [6, 16, 32, 64, 128])
def test_rotary_is_bit_identical_to_torch_and_touches_only_its_view(dim: int) -> None:
    """The rotation of a fused q/k/v buffer's q and k heads, in place: exactly what
    apply_rotary returns, and the v heads beside them untouched."""
    g = torch.Generator().manual_seed(dim)
    tokens, qk_heads, v_heads = 37, 12, 3
    qkv = torch.randn(tokens, qk_heads + v_heads, dim, generator=g)
    before = qkv.clone()
    angles = torch.rand(tokens, dim // 2, generator=g) * 100
    emb = torch.cat((angles, angles), -1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    expected = apply_rotary(before[:, :qk_heads], cos, sin)
    cpu_kernels.rotary_(qkv[:, :qk_heads], cos[:, 0].contiguous(), sin[:, 0].contiguous())
    assert torch.equal(qkv[:, :qk_heads], expected)
    assert torch.equal(qkv[:, qk_heads:], before[:, qk_heads:])


def test_rotary_with_halves_that_differ_matches_the_formula() -> None:
    """Nothing assumes cos's two halves are equal: each half is read where it lies."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 64, generator=g)
    cos, sin = torch.randn(5, 1, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    expected = apply_rotary(x, cos, sin)
    cpu_kernels.rotary_(x, cos[:, 0].contiguous(), sin[:, 0].contiguous())
    assert torch.equal(x, expected)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), inner=st.sampled_from([1, 8, 16, 31, 1536]))
def test_silu_and_mul_equals_torch(rows: int, inner: int) -> None:
    g = torch.Generator().manual_seed(rows * 13 + inner)
    x = torch.randn(rows, 2 * inner, generator=g) * 6
    got = cpu_kernels.silu_and_mul(x)
    assert got.shape == (rows, inner)
    gate, up = x.double().chunk(2, -1)
    torch.testing.assert_close(got, (F.silu(gate) * up).float(), rtol=3e-6, atol=1e-6)


def test_silu_and_mul_at_the_ends_of_the_range() -> None:
    gate = torch.tensor([-200.0, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 88.0, 200.0, float("nan")])
    x = torch.cat([gate, torch.full_like(gate, 2.0)])[None]
    got = cpu_kernels.silu_and_mul(x)[0]
    expected = (F.silu(gate.double()) * 2).float()
    torch.testing.assert_close(got[:-1], expected[:-1], rtol=3e-6, atol=1e-30)
    assert torch.isnan(got[-1])


def test_kernels_refuse_what_they_cannot_take() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
    with pytest.raises(RuntimeError, match="delta"):
        cpu_kernels.add_rms_norm_(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="D even"):
        cpu_kernels.rotary_(torch.randn(2, 2, 7), torch.randn(2, 7), torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.rotary_(torch.randn(2, 2, 8), torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="2I"):
        cpu_kernels.silu_and_mul(torch.randn(2, 7))


def _all_ops(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Every layer_ops function on copies of the inputs (they update in place)."""
    residual = x.clone()
    summed = layer_ops.add_rms_norm_(residual, delta, w, 1e-5)
    tokens, width = x.shape
    heads = x.view(tokens, width // 16, 16).clone()
    angles = torch.arange(tokens, dtype=x.dtype)[:, None] * torch.linspace(0.1, 1, 8, dtype=x.dtype)
    emb = torch.cat((angles, angles), -1)[:, None, :]
    rotated = layer_ops.rotate(heads, emb.cos(), emb.sin())
    return [layer_ops.rms_norm(x, w, 1e-5), summed, residual, rotated, layer_ops.silu_and_mul(x)]


def test_dispatch_uses_the_kernels_on_float32_cpu_and_torch_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(3)
    x, delta, w = torch.randn(9, 64, generator=g), torch.randn(9, 64, generator=g), torch.randn(64)
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm_", "rotary_", "silu_and_mul"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    kernel = _all_ops(x, delta, w)
    assert sorted(calls) == ["add_rms_norm_", "rms_norm", "rotary_", "silu_and_mul"]
    calls.clear()
    # bfloat16 is torch's: its norm runs in float32 like HF's, which the kernel does not.
    _all_ops(x.bfloat16(), delta.bfloat16(), w.bfloat16())
    assert calls == []
    monkeypatch.setattr(cpu_kernels, "layer_ops_supported", lambda t: False)
    fallback = _all_ops(x, delta, w)
    assert calls == []
    for got, expected in zip(kernel, fallback, strict=True):
        torch.testing.assert_close(got, expected, rtol=3e-6, atol=3e-6)


def test_rotate_leaves_shapes_the_kernel_does_not_take_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One angle broadcast over every token is torch's broadcasting, not the kernel's
    [tokens, D]: the dispatch must not hand it over (nor rotate in place)."""
    monkeypatch.setattr(cpu_kernels, "rotary_", lambda *a: pytest.fail("kernel called"))
    x = torch.randn(5, 3, 8)
    angle = torch.linspace(0, 1, 8)[None, None, :]
    got = layer_ops.rotate(x, angle.cos(), angle.sin())
    assert got is not x
    assert torch.equal(got, apply_rotary(x, angle.cos(), angle.sin()))
