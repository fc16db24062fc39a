// A few rows times a weight matrix, y = x W^T (+ b), float32 on the CPU (AVX-512),
// for 2 to 16 rows. Registered as torch.ops.cachepoint.small_matmul.
//
// Why: a decode batch's linears multiply a handful of rows by every weight. The
// weights must stream from memory once a step, and each weight is used once per row:
// too few uses for the blocked GEMMs of MKL and oneDNN to pay their packing, which
// measured here ran at 13 GB/s on 8 rows against a plain read's 23. This kernel reads
// each pair of weight rows once and multiplies it by every x row held in L1, eight
// rows a pass, then sums the lanes of the 16 accumulators with one transpose-and-add.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRowsPerTask = 64;  // weight rows (outputs) a thread takes at a time
constexpr int64_t kMaxRows = 16;

// out[j] = sum of a[j]'s 16 lanes (see paged_decode.cpp).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

struct Args {
  const float* x;  // [m, k], rows ldx apart
  int64_t ldx;
  const float* w;  // [n, k], rows ldw apart
  int64_t ldw;
  const float* bias;  // [n] or null
  float* y;           // [m, n], contiguous
  int64_t m, n, k;
};

// Outputs n0, n0+1 (the second only when `two`) for x rows r0..r0+MB-1.
template <int MB>
inline void pair(const Args& a, int64_t n0, bool two, int64_t r0) {
  const float* w0 = a.w + n0 * a.ldw;
  const float* w1 = two ? w0 + a.ldw : w0;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full = a.k / 16 * 16;
  const float* xr = a.x + r0 * a.ldx;
  // NOTE: the next pair's rows are prefetched as this pair streams: two rows alone
  // are too few streams in flight to reach the memory's bandwidth.
  const float* next = w0 + 2 * a.ldw;
  const bool prefetch = n0 + 3 < a.n;
  for (int64_t i = 0; i < full; i += 16) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + a.ldw + i), _MM_HINT_T0);
    }
    const __m512 u = _mm512_loadu_ps(w0 + i), v = _mm512_loadu_ps(w1 + i);
    for (int r = 0; r < MB; ++r) {
      const __m512 xv = _mm512_loadu_ps(xr + r * a.ldx + i);
      acc[r] = _mm512_fmadd_ps(u, xv, acc[r]);
      acc[8 + r] = _mm512_fmadd_ps(v, xv, acc[8 + r]);
    }
  }
  if (full < a.k) {
    const __mmask16 tail = __mmask16((1u << (a.k - full)) - 1);
    const __m512 u = _mm512_maskz_loadu_ps(tail, w0 + full);
    const __m512 v = _mm512_maskz_loadu_ps(tail, w1 + full);
    for (int r = 0; r < MB; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, xr + r * a.ldx + full);
      acc[r] = _mm512_fmadd_ps(u, xv, acc[r]);
      acc[8 + r] = _mm512_fmadd_ps(v, xv, acc[8 + r]);
    }
  }
  alignas(64) float s[16];
  _mm512_store_ps(s, sum16(acc));
  const float b0 = a.bias ? a.bias[n0] : 0.0f;
  const float b1 = a.bias && two ? a.bias[n0 + 1] : 0.0f;
  for (int r = 0; r < MB; ++r) {
    a.y[(r0 + r) * a.n + n0] = s[r] + b0;
    if (two) a.y[(r0 + r) * a.n + n0 + 1] = s[8 + r] + b1;
  }
}

template <int MB>
void outputs(const Args& a, int64_t n0, int64_t n1, int64_t r0) {
  for (int64_t n = n0; n < n1; n += 2) pair<MB>(a, n, n + 1 < n1, r0);
}

using OutputsFn = void (*)(const Args&, int64_t, int64_t, int64_t);
constexpr OutputsFn kByRows[9] = {nullptr,    outputs<1>, outputs<2>, outputs<3>, outputs<4>,
                                  outputs<5>, outputs<6>, outputs<7>, outputs<8>};

at::Tensor small_matmul(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "small_matmul needs a CPU with AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_matmul takes float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "x must be [rows, K] with contiguous rows, 1 to ", kMaxRows, " rows");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1 && weight.size(1) == x.size(1),
              "weight must be [N, K] with contiguous rows, K matching x");
  Args a{};
  a.x = x.data_ptr<float>();
  a.ldx = x.stride(0);
  a.w = weight.data_ptr<float>();
  a.ldw = weight.stride(0);
  a.m = x.size(0);
  a.n = weight.size(0);
  a.k = weight.size(1);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == a.n && bias->is_contiguous(),
                "bias must be a contiguous float32 [N]");
    a.bias = bias->data_ptr<float>();
  }
  auto y = at::empty({a.m, a.n}, x.options());
  a.y = y.data_ptr<float>();
  const int64_t tasks = (a.n + kRowsPerTask - 1) / kRowsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    const int64_t n0 = lo * kRowsPerTask, n1 = std::min(a.n, hi * kRowsPerTask);
    // NOTE: x rows in passes of eight over the same weight rows: the second pass finds
    // them in L1/L2, so memory still sees each weight once.
    for (int64_t t = n0; t < n1; t += kRowsPerTask) {
      const int64_t t1 = std::min(n1, t + kRowsPerTask);
      for (int64_t r0 = 0; r0 < a.m; r0 += 8) kByRows[std::min<int64_t>(8, a.m - r0)](a, t, t1, r0);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachepoint, m) {
  m.def("small_matmul(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(cachepoint, CPU, m) { m.impl("small_matmul", &small_matmul); }
