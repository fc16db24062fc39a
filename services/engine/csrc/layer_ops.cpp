// The elementwise steps of a decoder layer, each one pass over memory, float32 on the
// CPU (AVX-512). Registered as torch.ops.cachepoint.{rms_norm, add_rms_norm_, rotary_,
// silu_and_mul}.
//
// Why: torch runs these as chains of small ops. On this CPU build F.rms_norm is not
// fused (pow, mean, add, rsqrt, mul, mul), the rotation is five ops (neg, cat, two
// muls, add) and SiLU-and-multiply two, each a full pass over a fresh buffer. A cold
// 1,814-token SmolLM2 prefill spent about 0.3 s of 2.6 s in them, and a decode step
// pays the dispatch of some 25 ops a layer (bench/RESULTS.md, "One pass for the
// elementwise ops"). vLLM's CPU build ships the same four as custom ops.
//
// NOTE: each formula is written as torch's reference computes it (the same products
// and sums, no fused multiply-add where torch has none), so the rotation matches torch
// bit for bit; the norms sum squares in a different order and SiLU uses its own exp,
// both within float32 rounding of torch's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

// NOTE: GCC otherwise contracts a product and the sum that follows into one fused
// multiply-add, a different rounding from torch's two ops (the rotation would then
// differ from torch's in the last bit of a quarter of its values).
#pragma GCC optimize("fp-contract=off")

namespace {

using cachepoint_vec::exp_ps;

// Rows a thread takes at least: below this many values a pass is cheaper than waking
// the other threads.
constexpr int64_t kMinValuesPerTask = 16384;

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// 1 / sqrt(mean(x^2) + eps) of one row, as torch.rsqrt would give it.
inline float inv_rms(const float* x, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + eps);
}

// out = (x * inv) * w, the order torch's reference multiplies in.
inline void scale_row(const float* x, const float* w, float inv, float* out, int64_t n) {
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), name, " needs a CPU with AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, name,
              " takes float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, H], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), name,
              ": weight must be a contiguous [H]");
}

int64_t row_grain(int64_t width) { return std::max<int64_t>(1, kMinValuesPerTask / width); }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* row = xp + r * ld;
      scale_row(row, wp, inv_rms(row, n, e), op + r * n, n);
    }
  });
  return out;
}

// residual += delta (in place), then returns rms_norm(residual) * weight: the residual
// add that closes one sublayer and the norm that opens the next, one pass per row
// while the row sits in L1.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  check_rows(residual, weight, "add_rms_norm_");
  TORCH_CHECK(delta.scalar_type() == at::kFloat && delta.dim() == 2 && delta.stride(1) == 1 &&
                  delta.sizes() == residual.sizes(),
              "add_rms_norm_: delta must be float32 [rows, H] like the residual");
  const int64_t rows = residual.size(0), n = residual.size(1);
  const int64_t ldr = residual.stride(0), ldd = delta.stride(0);
  auto out = at::empty({rows, n}, residual.options());
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* row = rp + r * ldr;
      const float* d = dp + r * ldd;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v =
            _mm512_add_ps(_mm512_maskz_loadu_ps(m, row + i), _mm512_maskz_loadu_ps(m, d + i));
        _mm512_mask_storeu_ps(row + i, m, v);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
      scale_row(row, wp, 1.0f / std::sqrt(mean + e), op + r * n, n);
    }
  });
  return out;
}

// Rotates x [tokens, heads, D] in place: x * cos + rotate_half(x) * sin, with cos and
// sin [tokens, D] (the same angle for every head of a token).
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "rotary_ needs a CPU with AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary_ takes float32");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x must be [tokens, heads, D] with D even and contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.size(0) == tokens && cos.size(1) == dim,
              "rotary_: cos and sin must be contiguous [tokens, D]");
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, tokens * heads, row_grain(dim), [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / heads, h = task % heads;
      float* p = xp + t * st + h * sh;
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = _mm512_maskz_loadu_ps(m, p + i);
        const __m512 x2 = _mm512_maskz_loadu_ps(m, p + half + i);
        // rotate_half(x) is (-x2, x1): the first half x1*c - x2*s, the second x2*c + x1*s.
        const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, c + i)),
                                        _mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, s + i)));
        const __m512 o2 =
            _mm512_add_ps(_mm512_mul_ps(x2, _mm512_maskz_loadu_ps(m, c + half + i)),
                          _mm512_mul_ps(x1, _mm512_maskz_loadu_ps(m, s + half + i)));
        _mm512_mask_storeu_ps(p + i, m, o1);
        _mm512_mask_storeu_ps(p + half + i, m, o2);
      }
    }
  });
}

// x [rows, 2I] (the gate and up projections side by side) -> silu(gate) * up [rows, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "silu_and_mul needs a CPU with AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_and_mul takes float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2I], rows contiguous");
  const int64_t rows = x.size(0), inner = x.size(1) / 2, ld = x.stride(0);
  auto out = at::empty({rows, inner}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = xp + r * ld;
      const float* u = g + inner;
      float* o = op + r * inner;
      for (int64_t i = 0; i < inner; i += 16) {
        const __mmask16 m = tail_mask(inner - i);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        // silu(g) = g / (1 + exp(-g)), as torch writes it.
        const __m512 den = _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
        const __m512 silu = _mm512_div_ps(gv, den);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachepoint, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(cachepoint, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
