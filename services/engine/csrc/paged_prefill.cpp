// Causal prefill attention that reads K/V through a block table, on the CPU
// (float32, AVX-512). Registered as torch.ops.cachepoint.paged_prefill.
//
// Why a kernel of our own: torch's CPU flash kernel takes dense K/V, so a cached
// prefix must arrive as views or gathered copies, and the step's new tokens as another
// call merged by log-sum-exp. At the head sizes of the models served on CPUs (16 to
// 64) that kernel also spends most of its time on per-tile bookkeeping. Here one call
// covers the whole context (the cached blocks and the step's own, already written to
// the pool), with the lower-right causal mask applied on the diagonal tiles only.
//
// The work: a task is one KV head and 16 query rows, the GQA group's heads folded in
// as rows (they read the same K/V head). The 16 rows are the 16 lanes of a vector, so
// the online softmax's max, exp and sum are plain vector ops across keys, and neither
// K nor V is ever transposed: each key's values are broadcast from the pool as FMA
// memory operands.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using cachepoint_vec::exp2_nonpositive;

constexpr int kRows = 16;  // query rows of one task: one AVX-512 vector of float32
constexpr int kTile = 64;  // keys per online-softmax tile (its scores stay in L1)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Task {
  const float* q;        // [tokens, q_heads, D], last dim contiguous
  int64_t q_tok;         // q's token stride
  int64_t q_head;        // q's head stride
  float* out;            // [tokens, q_heads, D], contiguous
  float* lse;            // [tokens, q_heads] natural log-sum-exp, contiguous
  int64_t q_heads;
  const float* k;        // this KV head's K [num_blocks, block_size, D]
  const float* v;        // and V
  const int32_t* table;  // the sequence's pool block ids, in position order
  int64_t block_size;
  int64_t cached;        // positions before the first query row
  int64_t group;         // query heads per KV head
  int64_t kv_head;
  int64_t first;         // first folded row (token * group + head within the group)
  int rows;              // folded rows of this task, 1..16
  float scale;           // softmax scale times log2(e): scores in log2 units
};

template <int D>
void run_task(const Task& t) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  alignas(64) float qt[D][kRows];   // the rows' queries, transposed and pre-scaled
  alignas(64) float acc[D][kRows];  // unnormalized outputs, transposed
  alignas(64) float s[kTile][kRows];
  alignas(64) int32_t pos_arr[kRows];
  const float* krow[kTile];
  const float* vrow[kTile];

  for (int r = 0; r < kRows; ++r) {
    // NOTE: lanes past `rows` repeat the last row, so every lane has finite scores
    // (no NaN from an empty row); they are never written out.
    const int64_t f = t.first + std::min(r, t.rows - 1);
    const int64_t tok = f / t.group;
    const int64_t head = t.kv_head * t.group + f % t.group;
    const float* src = t.q + tok * t.q_tok + head * t.q_head;
    for (int d = 0; d < D; ++d) qt[d][r] = src[d] * t.scale;
    pos_arr[r] = int32_t(t.cached + tok);
  }
  for (int d = 0; d < D; ++d) _mm512_store_ps(acc[d], _mm512_setzero_ps());
  const __m512i pos = _mm512_load_si512(pos_arr);
  const int64_t end = t.cached + (t.first + t.rows - 1) / t.group + 1;  // the last row's keys
  const int64_t all = t.cached + t.first / t.group + 1;  // keys every row of the task sees
  const int64_t block_elems = t.block_size * D;
  __m512 m = _mm512_set1_ps(-INFINITY);
  __m512 l = _mm512_setzero_ps();

  for (int64_t j0 = 0; j0 < end; j0 += kTile) {
    const int n = int(std::min<int64_t>(kTile, end - j0));
    {
      // NOTE: the tile's slot addresses once, walking the table: no division per key.
      int64_t b = j0 / t.block_size, o = j0 % t.block_size;
      int64_t off = t.table[b] * block_elems + o * D;
      for (int j = 0; j < n; ++j) {
        krow[j] = t.k + off;
        vrow[j] = t.v + off;
        if (++o == t.block_size) {
          o = 0;
          if (j + 1 < n) off = t.table[++b] * block_elems;
        } else {
          off += D;
        }
      }
    }
    // Scores, eight keys at a time: eight independent FMA chains keep both FMA ports
    // busy (four left them half idle on their 4-cycle latency). The tile's max rides
    // along; on the diagonal, key j is visible to row r only when j <= pos[r]
    // (lower-right causal: every cached key is visible to all rows).
    const bool diagonal = j0 + n > all;
    __m512 mt = _mm512_set1_ps(-INFINITY);
    auto keep_max = [&](int j, __m512 a) {
      if (diagonal) {
        const __mmask16 vis = _mm512_cmple_epi32_mask(_mm512_set1_epi32(int32_t(j0 + j)), pos);
        mt = _mm512_mask_max_ps(mt, vis, mt, a);
      } else {
        mt = _mm512_max_ps(mt, a);
      }
      _mm512_store_ps(s[j], a);
    };
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      const float* kr[8];
      for (int u = 0; u < 8; ++u) kr[u] = krow[j + u];
      __m512 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        const __m512 qd = _mm512_load_ps(qt[d]);
        for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kr[u][d]), a[u]);
      }
      for (int u = 0; u < 8; ++u) keep_max(j + u, a[u]);
    }
    for (; j < n; ++j) {
      const float* k0 = krow[j];
      __m512 a0 = _mm512_setzero_ps(), a1 = a0;
      for (int d = 0; d + 1 < D; d += 2) {
        a0 = _mm512_fmadd_ps(_mm512_load_ps(qt[d]), _mm512_set1_ps(k0[d]), a0);
        a1 = _mm512_fmadd_ps(_mm512_load_ps(qt[d + 1]), _mm512_set1_ps(k0[d + 1]), a1);
      }
      keep_max(j, _mm512_add_ps(a0, a1));
    }

    // Online softmax: rescale by the new max, then exponentiate each key's scores and
    // add its values, 16 output dims at a time held in registers. The first 16 take
    // the exponentials as they come; wider heads keep them for their other dims.
    const __m512 m_new = _mm512_max_ps(m, mt);
    const __m512 alpha = exp2_nonpositive(_mm512_sub_ps(m, m_new));
    m = m_new;
    l = _mm512_mul_ps(l, alpha);
    {
      __m512 o[16];
      for (int d = 0; d < 16; ++d) o[d] = _mm512_mul_ps(_mm512_load_ps(acc[d]), alpha);
      for (j = 0; j < n; ++j) {
        __m512 p = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(s[j]), m));
        if (diagonal) {
          const __mmask16 vis = _mm512_cmple_epi32_mask(_mm512_set1_epi32(int32_t(j0 + j)), pos);
          p = _mm512_maskz_mov_ps(vis, p);
        }
        l = _mm512_add_ps(l, p);
        if (D > 16) _mm512_store_ps(s[j], p);
        const float* vr = vrow[j];
        for (int d = 0; d < 16; ++d) o[d] = _mm512_fmadd_ps(p, _mm512_set1_ps(vr[d]), o[d]);
      }
      for (int d = 0; d < 16; ++d) _mm512_store_ps(acc[d], o[d]);
    }
    for (int c = 16; c < D; c += 16) {
      __m512 o[16];
      for (int d = 0; d < 16; ++d) o[d] = _mm512_mul_ps(_mm512_load_ps(acc[c + d]), alpha);
      for (j = 0; j < n; ++j) {
        const __m512 pj = _mm512_load_ps(s[j]);
        const float* vr = vrow[j] + c;
        for (int d = 0; d < 16; ++d) o[d] = _mm512_fmadd_ps(pj, _mm512_set1_ps(vr[d]), o[d]);
      }
      for (int d = 0; d < 16; ++d) _mm512_store_ps(acc[c + d], o[d]);
    }
  }

  alignas(64) float inv[kRows];
  alignas(64) float mx[kRows];
  alignas(64) float sum[kRows];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
  _mm512_store_ps(mx, m);
  _mm512_store_ps(sum, l);
  for (int r = 0; r < t.rows; ++r) {
    const int64_t f = t.first + r;
    const int64_t at = (f / t.group) * t.q_heads + t.kv_head * t.group + f % t.group;
    float* dst = t.out + at * D;
    for (int d = 0; d < D; ++d) dst[d] = acc[d][r] * inv[r];
    t.lse[at] = (mx[r] + std::log2(sum[r])) * kLn2;
  }
}

using TaskFn = void (*)(const Task&);

TaskFn task_for(int64_t dim) {
  switch (dim) {
    case 16: return run_task<16>;
    case 32: return run_task<32>;
    case 48: return run_task<48>;
    case 64: return run_task<64>;
    case 80: return run_task<80>;
    case 96: return run_task<96>;
    case 128: return run_task<128>;
    default: return nullptr;
  }
}

bool supports(int64_t head_dim) {
  return __builtin_cpu_supports("avx512f") && task_for(head_dim) != nullptr;
}

std::tuple<at::Tensor, at::Tensor> paged_prefill(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, int64_t cached, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "paged_prefill needs a CPU with AVX-512");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [tokens, q_heads, D] and caches [kv_heads, blocks, block_size, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_prefill takes float32");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 1 &&
                  block_table.is_contiguous(),
              "block_table must be a contiguous int32 vector");
  const int64_t tokens = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == dim,
              "K and V caches must match each other and q's head_dim");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == dim &&
                  k_cache.stride(1) == block_size * dim && v_cache.strides() == k_cache.strides(),
              "each KV head's blocks must be contiguous [blocks, block_size, D]");
  TORCH_CHECK(q_heads % kv_heads == 0, "q_heads must be a multiple of kv_heads");
  TORCH_CHECK(cached >= 0 && block_table.size(0) * block_size >= cached + tokens,
              "block_table covers ", block_table.size(0) * block_size, " slots, but ",
              cached + tokens, " are attended");
  const TaskFn fn = task_for(dim);
  TORCH_CHECK(fn != nullptr, "head_dim ", dim, " is not supported");

  auto out = at::empty({tokens, q_heads, dim}, q.options());
  auto lse = at::empty({tokens, q_heads}, q.options());
  if (tokens == 0) return {out, lse};
  const int64_t group = q_heads / kv_heads;
  const int64_t folded = tokens * group;
  const int64_t per_head = (folded + kRows - 1) / kRows;
  Task base{};
  base.q = q.data_ptr<float>();
  base.q_tok = q.stride(0);
  base.q_head = q.stride(1);
  base.out = out.data_ptr<float>();
  base.lse = lse.data_ptr<float>();
  base.q_heads = q_heads;
  base.table = block_table.data_ptr<int32_t>();
  base.block_size = block_size;
  base.cached = cached;
  base.group = group;
  base.scale = float(scale) * kLog2e;
  const float* k0 = k_cache.data_ptr<float>();
  const float* v0 = v_cache.data_ptr<float>();
  const int64_t head_stride = k_cache.stride(0);
  // NOTE: a chunk of rows costs its number of keys, which grows along the prompt
  // (causal), and at::parallel_for splits the range into one contiguous part per
  // thread. In prompt order the thread with the last rows did three times the work of
  // the one with the first on 2 threads (SmolLM2's cold 1,814 rows: 29.3 ms a layer,
  // 21.7 ms once balanced). The range
  // runs the chunks zigzag instead: first, last, second, second-to-last..., so every
  // part holds pairs whose costs sum to the same, whatever the thread count.
  at::parallel_for(0, kv_heads * per_head, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      Task t = base;
      t.kv_head = i % kv_heads;
      const int64_t p = i / kv_heads;
      const int64_t chunk = (p % 2 == 0) ? p / 2 : per_head - 1 - p / 2;
      t.first = chunk * kRows;
      t.rows = int(std::min<int64_t>(kRows, folded - t.first));
      t.k = k0 + t.kv_head * head_stride;
      t.v = v0 + t.kv_head * head_stride;
      fn(t);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(cachepoint, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int cached, float scale) -> (Tensor, Tensor)");
  m.def("paged_prefill_supports(int head_dim) -> bool", &supports);
}

TORCH_LIBRARY_IMPL(cachepoint, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
