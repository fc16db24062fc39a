// Decode attention that reads K/V through block tables, on the CPU (float32,
// AVX-512). Registered as torch.ops.cachepoint.paged_decode.
//
// Why: a decode step reads every cached K/V once per layer, so it is bound by memory
// bandwidth, and torch's flash kernel splits only over heads and query blocks: a lone
// sequence with 3 KV heads keeps 2 threads busy 2/3 of the time, and the context must
// come as views or gathered copies planned run by run in Python. Here each lane's
// keys are split into chunks read in place through its table (flash-decoding), the
// chunks of all lanes and heads share the threads, and the partials are merged by
// their log-sum-exp in a second pass.
//
// Within a chunk a task scores 16 keys at a time for each query row of the GQA group
// (the heads reading one KV head): each score a dot product over head_dim, so the 16
// scores of a row are one vector for the online softmax.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using cachepoint_vec::exp2_nonpositive;

constexpr int kKeys = 16;       // keys scored together: one vector of scores per row
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int64_t kChunk = 512;  // keys per task, at least (a chunk's K/V: 64-256 KiB)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The 16 lane sums of a[0..15], as one vector: out[j] = sum(a[j]). A transpose-and-add
// tree, 45 shuffles and adds for 16 dot products instead of 16 horizontal reductions
// of 8 dependent steps each.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // keys 2i, 2i+1 alternate lanes
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane holds keys 4i..4i+3
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes 0-1 and 2-3 hold keys 8i..8i+3 and 8i+4..8i+7
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

struct Chunk {
  const float* q;        // the group's first query head, [group, D] with head stride q_head
  int64_t q_head;
  const float* k;        // this KV head's K [num_blocks, block_size, D]
  const float* v;
  const int32_t* table;  // the lane's block ids
  int64_t block_size;
  int64_t begin, end;    // key positions of the chunk
  int group;
  float scale;           // softmax scale in log2 units
  float* acc;            // out: [group, D] unnormalized
  float* m;              // out: [group] running max (log2 units)
  float* l;              // out: [group] sum of exponentials
};

template <int D>
void run_chunk(const Chunk& c) {
  constexpr int V = D / 16;  // vectors per head row
  __m512 q[kMaxGroup][V];
  __m512 o[kMaxGroup][V];
  float m[kMaxGroup], l[kMaxGroup];
  for (int r = 0; r < c.group; ++r) {
    const float* src = c.q + r * c.q_head;
    for (int u = 0; u < V; ++u) {
      q[r][u] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * u), _mm512_set1_ps(c.scale));
      o[r][u] = _mm512_setzero_ps();
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const float* krow[kKeys];
  const float* vrow[kKeys];
  alignas(64) float s[kKeys];
  const int64_t block_elems = c.block_size * D;
  int64_t b = c.begin / c.block_size, off_in = c.begin % c.block_size;
  int64_t base = int64_t(c.table[b]) * block_elems;
  for (int64_t j0 = c.begin; j0 < c.end; j0 += kKeys) {
    const int n = int(std::min<int64_t>(kKeys, c.end - j0));
    for (int j = 0; j < n; ++j) {
      krow[j] = c.k + base + off_in * D;
      vrow[j] = c.v + base + off_in * D;
      if (++off_in == c.block_size && j0 + j + 1 < c.end) {
        off_in = 0;
        base = int64_t(c.table[++b]) * block_elems;
      }
    }
    const __mmask16 live = n == kKeys ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    for (int j = n; j < kKeys; ++j) krow[j] = krow[0];  // a short tile scores key 0 again
    for (int r = 0; r < c.group; ++r) {
      __m512 a[kKeys];
      for (int j = 0; j < kKeys; ++j) {
        a[j] = _mm512_mul_ps(q[r][0], _mm512_loadu_ps(krow[j]));
        for (int u = 1; u < V; ++u) a[j] = _mm512_fmadd_ps(q[r][u], _mm512_loadu_ps(krow[j] + 16 * u), a[j]);
      }
      const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sum16(a));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(sv));
      const float alpha = std::exp2(m[r] - m_new);  // 0 on the first block (m = -inf)
      const __m512 p = _mm512_maskz_mov_ps(live, exp2_nonpositive(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
      m[r] = m_new;
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(p);
      _mm512_store_ps(s, p);
      for (int u = 0; u < V; ++u) o[r][u] = _mm512_mul_ps(o[r][u], _mm512_set1_ps(alpha));
      for (int j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(s[j]);
        for (int u = 0; u < V; ++u) o[r][u] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vrow[j] + 16 * u), o[r][u]);
      }
    }
  }
  for (int r = 0; r < c.group; ++r) {
    for (int u = 0; u < V; ++u) _mm512_storeu_ps(c.acc + r * D + 16 * u, o[r][u]);
    c.m[r] = m[r];
    c.l[r] = l[r];
  }
}

using ChunkFn = void (*)(const Chunk&);

ChunkFn chunk_for(int64_t dim) {
  switch (dim) {
    case 16: return run_chunk<16>;
    case 32: return run_chunk<32>;
    case 48: return run_chunk<48>;
    case 64: return run_chunk<64>;
    case 80: return run_chunk<80>;
    case 96: return run_chunk<96>;
    case 128: return run_chunk<128>;
    default: return nullptr;
  }
}

bool supports(int64_t head_dim, int64_t group) {
  return __builtin_cpu_supports("avx512f") && chunk_for(head_dim) != nullptr && group >= 1 &&
         group <= kMaxGroup;
}

// q [lanes, q_heads, D]; lane i attends its keys start..lengths[i]-1 through
// block_tables[i]; returns the output [lanes, q_heads, D] and its natural log-sum-exp
// [lanes, q_heads] (-inf, with output 0, for a lane with no keys in the range).
std::tuple<at::Tensor, at::Tensor> paged_decode(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& lengths, int64_t start, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f"), "paged_decode needs a CPU with AVX-512");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [lanes, q_heads, D] and caches [kv_heads, blocks, block_size, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode takes float32");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1,
              "block_tables must be int32 [lanes, width] with contiguous rows");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.is_contiguous(),
              "lengths must be a contiguous int64 vector");
  const int64_t lanes = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == dim,
              "K and V caches must match each other and q's head_dim");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == dim &&
                  k_cache.stride(1) == block_size * dim && v_cache.strides() == k_cache.strides(),
              "each KV head's blocks must be contiguous [blocks, block_size, D]");
  TORCH_CHECK(q_heads % kv_heads == 0, "q_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.size(0) == lanes && lengths.size(0) == lanes,
              "one block table row and one length per lane");
  const int64_t group = q_heads / kv_heads;
  TORCH_CHECK(supports(dim, group), "head_dim ", dim, " with ", group,
              " query heads per KV head is not supported");
  TORCH_CHECK(start >= 0, "start must be >= 0");
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  int64_t longest = 0;
  for (int64_t i = 0; i < lanes; ++i) {
    TORCH_CHECK(len[i] >= 0 && len[i] <= width * block_size, "lane ", i, " attends ", len[i],
                " keys but its table covers ", width * block_size);
    longest = std::max(longest, len[i] - start);
  }

  // NOTE: chunks are at least kChunk keys, and lanes * heads * chunks makes about four
  // tasks a thread, so short contexts are not split into pieces smaller than a call.
  const int64_t threads = at::get_num_threads();
  const int64_t per_lane = std::max<int64_t>(1, (8 * threads + lanes * kv_heads - 1) / (lanes * kv_heads));
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(per_lane, (longest + kChunk - 1) / kChunk));
  const int64_t span = std::max<int64_t>(1, (longest + chunks - 1) / chunks);
  const int64_t tasks = lanes * kv_heads * chunks;
  std::vector<float> acc(size_t(tasks * group * dim));
  std::vector<float> mx(size_t(tasks * group), -INFINITY), sm(size_t(tasks * group), 0.0f);

  const ChunkFn fn = chunk_for(dim);
  const float* q0 = q.data_ptr<float>();
  const float* k0 = k_cache.data_ptr<float>();
  const float* v0 = v_cache.data_ptr<float>();
  const int32_t* t0 = block_tables.data_ptr<int32_t>();
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t lane = i / (kv_heads * chunks), h = (i / chunks) % kv_heads, part = i % chunks;
      Chunk c{};
      c.begin = start + part * span;
      c.end = std::min(len[lane], c.begin + span);
      if (c.begin >= c.end) continue;  // m stays -inf: weighs nothing in the merge
      c.q = q0 + lane * q.stride(0) + h * group * q.stride(1);
      c.q_head = q.stride(1);
      c.k = k0 + h * k_cache.stride(0);
      c.v = v0 + h * v_cache.stride(0);
      c.table = t0 + lane * block_tables.stride(0);
      c.block_size = block_size;
      c.group = int(group);
      c.scale = float(scale) * kLog2e;
      c.acc = acc.data() + i * group * dim;
      c.m = mx.data() + i * group;
      c.l = sm.data() + i * group;
      fn(c);
    }
  });

  auto out = at::empty({lanes, q_heads, dim}, q.options());
  auto lse = at::empty({lanes, q_heads}, q.options());
  float* po = out.data_ptr<float>();
  float* pl = lse.data_ptr<float>();
  for (int64_t lane = 0; lane < lanes; ++lane) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t first = (lane * kv_heads + h) * chunks;
      for (int64_t r = 0; r < group; ++r) {
        float m = -INFINITY;
        for (int64_t p = 0; p < chunks; ++p) m = std::max(m, mx[(first + p) * group + r]);
        float* dst = po + (lane * q_heads + h * group + r) * dim;
        std::fill(dst, dst + dim, 0.0f);
        float total = 0.0f;
        if (m != -INFINITY) {
          for (int64_t p = 0; p < chunks; ++p) {
            const int64_t at_ = (first + p) * group + r;
            if (mx[at_] == -INFINITY) continue;
            const float w = std::exp2(mx[at_] - m);
            total += sm[at_] * w;
            const float* src = acc.data() + at_ * dim;
            for (int64_t d = 0; d < dim; ++d) dst[d] += src[d] * w;
          }
          const float inv = 1.0f / total;
          for (int64_t d = 0; d < dim; ++d) dst[d] *= inv;
        }
        pl[lane * q_heads + h * group + r] = m == -INFINITY ? -INFINITY : (m + std::log2(total)) * kLn2;
      }
    }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cachepoint, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor lengths, int start, float scale) -> (Tensor, Tensor)");
  m.def("paged_decode_supports(int head_dim, int group) -> bool", &supports);
}

TORCH_LIBRARY_IMPL(cachepoint, CPU, m) { m.impl("paged_decode", &paged_decode); }
