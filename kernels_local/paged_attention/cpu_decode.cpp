// Paged decode attention on the CPU: one query token per row, reading K/V in place through the
// block table (kernels_local/paged_attention/cpu.py says why and how it is built and checked).
//
// For each (row, KV head) the kernel walks the row's blocks once: each key and value row is read
// once for every query head of the group and converted to fp32, the block's scores (q.k times
// scale, soft-capped where asked) fold into a running softmax (max, sum, weighted V) in fp32,
// so no gathered copy of the rows' K/V is ever written; the blocks two ahead are prefetched.
// A head of whole vectors (`decode_rows_vec`: 32 to 512 dims) keeps its rows in registers, sums a
// tile of keys' dot products together into one vector of scores and takes the block's max, weights
// and their sum in vectors (scalar loops over a block's scores were chains of dependent adds and
// compares: a third of the kernel's time); any other head size stages each block in fp32
// (`decode_rows_any`). Tried and slower here: keys transposed to [D, B] for score vectors without
// horizontal sums, and the weighted values summed over the block per column; tried and not worth
// its code: bf16 pairs dotted by AVX512-BF16 (0.9x the time). Positions outside the row's length
// (or before its window) are skipped; gpt-oss's sink joins each head's softmax as a starting
// logit whose weight is dropped.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// What both kernels read: the decode rows' queries, the layer's pool and where each row's blocks lie.
template <typename T>
struct Rows {
  const T* q;              // [N, Hq, D] (row and head strides below)
  const T* k_pool;         // [Hkv, NB, B, D] this layer's keys
  const T* v_pool;         // the values, laid out as the keys
  const int64_t* tables;   // [N, width] block ids
  const int64_t* lens;     // [N] tokens held per row
  const float* sinks;      // [Hq] or null
  T* out;                  // [N, Hq, D]
  int64_t rows, heads, kv_heads, block, dim, width, q_row, q_head, pool_head, pool_block, window;
  float scale, softcap;

  // The first position row n's window reads (0 without a window) from its `len` tokens.
  int64_t first(int64_t len) const { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

  // Row n's query of head `head`.
  const T* query(int64_t n, int64_t head) const { return q + n * q_row + head * q_head; }

  // Where head `head`'s running softmax starts: its sink as a logit of weight 1, or nothing.
  float start_max(int64_t head) const { return sinks ? sinks[head] : -std::numeric_limits<float>::infinity(); }
  float start_sum() const { return sinks ? 1.f : 0.f; }

  // Where row n's block b (from its position lo) lies in KV head h.
  int64_t at(int64_t n, int64_t h, int64_t b, int64_t lo) const {
    return h * pool_head + tables[n * width + b] * pool_block + lo * dim;
  }

  // The block two ahead of (item, b), this row's else the next row's, on its way to the cache:
  // blocks lie anywhere in the pool, so the hardware's prefetcher cannot run ahead of the walk.
  void prefetch_ahead(int64_t item, int64_t b, int64_t len) const {
    int64_t n = item / kv_heads, h = item % kv_heads, ahead = b + 2;
    if (ahead * block >= len) {
      n = (item + 1) / kv_heads, h = (item + 1) % kv_heads, ahead -= (len + block - 1) / block;
    }
    if (n >= rows || ahead * block >= lens[n]) return;
    const char* kn = reinterpret_cast<const char*>(k_pool + at(n, h, ahead, 0));
    const char* vn = reinterpret_cast<const char*>(v_pool + at(n, h, ahead, 0));
    for (int64_t x = 0; x < int64_t(block * dim * sizeof(T)); x += 64) {
      __builtin_prefetch(kn + x);
      __builtin_prefetch(vn + x);
    }
  }
};

template <typename T>
void decode_rows_any(const Rows<T>& r) {
  const int64_t dim = r.dim, block = r.block, kv_heads = r.kv_heads;
  const int64_t group = r.heads / kv_heads;
  at::parallel_for(0, r.rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(block * dim), vf(block * dim), score(block);
    std::vector<float> run_max(group), run_sum(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / kv_heads, h = item % kv_heads;
      const int64_t len = r.lens[n];
      const int64_t first = r.first(len);
      // 1. this group's queries in fp32; each head's softmax starts from its sink (or nothing)
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = r.query(n, h * group + g);
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = static_cast<float>(qp[d]);
        run_max[g] = r.start_max(h * group + g);
        run_sum[g] = r.start_sum();
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // 2. the row's blocks, from the first its window reads, two ahead already on their way
      for (int64_t b = first / block; b * block < len; ++b) {
        r.prefetch_ahead(item, b, len);
        const int64_t lo = std::max(first - b * block, int64_t(0));
        const int64_t count = std::min(block, len - b * block) - lo;
        const int64_t base = r.at(n, h, b, lo);
        const T* kp = r.k_pool + base;
        const T* vp = r.v_pool + base;
        // 3. the block's keys and values in fp32, once for every query head of the group
#pragma omp simd
        for (int64_t x = 0; x < count * dim; ++x) {
          kf[x] = static_cast<float>(kp[x]);
          vf[x] = static_cast<float>(vp[x]);
        }
        for (int64_t g = 0; g < group; ++g) {
          // 4. the block's scores, scaled (and soft-capped)
          const float* qg = qf.data() + g * dim;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t p = 0; p < count; ++p) {
            const float* kr = kf.data() + p * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kr[d];
            float s = dot * r.scale;
            if (r.softcap > 0.f) s = std::tanh(s / r.softcap) * r.softcap;
            score[p] = s;
            block_max = std::max(block_max, s);
          }
          // 5. fold them into the running softmax: rescale what is held, add the block's weights
          const float new_max = std::max(run_max[g], block_max);
          const float keep = std::exp(run_max[g] - new_max);
          at::vec::map([new_max](Vec x) { return (x - Vec(new_max)).exp(); }, score.data(), score.data(), count);
          float* a = acc.data() + g * dim;
          float added = 0.f;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] *= keep;
          for (int64_t p = 0; p < count; ++p) {
            const float w = score[p];
            const float* vr = vf.data() + p * dim;
            added += w;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += w * vr[d];
          }
          run_sum[g] = run_sum[g] * keep + added;
          run_max[g] = new_max;
        }
      }
      // 6. normalize and write each head's output
      for (int64_t g = 0; g < group; ++g) {
        T* op = r.out + (n * r.heads + h * group + g) * dim;
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        for (int64_t d = 0; d < dim; ++d) op[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

// One vector of a row as fp32 (converted from 16-bit where the pool is).
template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// W partial dot vectors (one per key) -> one vector of their W sums, in key order: a tree of
// unpacks, lane shuffles and adds (45 instructions for 16 scores with AVX-512, where a horizontal
// sum per score takes about 8 each); without AVX-512 or AVX2, one horizontal sum per score.
inline Vec sum_lanes(const Vec* r) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = r[2 * i], b = r[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: four keys' partial sums
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // the four 128-bit lanes of each summed: keys 0-3, 4-7, 8-11, 12-15 in order
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = r[2 * i], b = r[2 * i + 1];
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(t[2 * i]), b = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#else
  float s[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) {
    Vec x = r[i];
    s[i] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
  }
  return Vec::loadu(s);
#endif
}

// The common case: a head of C whole vectors (D = C * Vec::size(), float or bfloat16). Keys
// are read in tiles of W (one vector's lanes): each key row is loaded into C vectors once and
// dotted with every query head of the group, and a tile's W partial vectors per head are summed
// together (`sum_lanes`) into one vector of scores; each value row likewise is added to every
// head's C accumulators. A group of G = 1, 2 or 4 query heads per KV head keeps the queries and
// accumulators in fixed arrays the compiler holds in registers (0.75-0.85x the time of G read at
// run time).
template <typename T, int C, int G>
void decode_rows_vec(const Rows<T>& r) {
  const int64_t dim = r.dim, block = r.block, kv_heads = r.kv_heads;
  constexpr int W = Vec::size();
  const int64_t group = G > 0 ? G : r.heads / kv_heads;
  at::parallel_for(0, r.rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<Vec> qv_any(G > 0 ? 0 : group * C), acc_any(G > 0 ? 0 : group * C), part(group * W);
    const int64_t padded = (block + W - 1) / W * W;
    std::vector<float> score(group * padded), run_max(group), run_sum(group);
    Vec qv_fixed[G > 0 ? G * C : 1], acc_fixed[G > 0 ? G * C : 1];
    Vec* qv = G > 0 ? qv_fixed : qv_any.data();
    Vec* acc = G > 0 ? acc_fixed : acc_any.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / kv_heads, h = item % kv_heads;
      const int64_t len = r.lens[n];
      const int64_t first = r.first(len);
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = r.query(n, h * group + g);
        for (int c = 0; c < C; ++c) {
          qv[g * C + c] = load_f(qp + c * W);
          acc[g * C + c] = Vec(0.f);
        }
        run_max[g] = r.start_max(h * group + g);
        run_sum[g] = r.start_sum();
      }
      for (int64_t b = first / block; b * block < len; ++b) {
        r.prefetch_ahead(item, b, len);
        const int64_t lo = std::max(first - b * block, int64_t(0));
        const int64_t count = std::min(block, len - b * block) - lo;
        const int64_t base = r.at(n, h, b, lo);
        for (int64_t p0 = 0; p0 < count; p0 += W) {
          const int64_t tile = std::min<int64_t>(W, count - p0);
          for (int64_t p = 0; p < tile; ++p) {
            Vec k[C];
            for (int c = 0; c < C; ++c) k[c] = load_f(r.k_pool + base + (p0 + p) * dim + c * W);
            for (int64_t g = 0; g < group; ++g) {
              Vec d = qv[g * C] * k[0];
              for (int c = 1; c < C; ++c) d = at::vec::fmadd(qv[g * C + c], k[c], d);
              part[g * W + p] = d;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            for (int64_t p = tile; p < W; ++p) part[g * W + p] = Vec(0.f);
            Vec s = sum_lanes(part.data() + g * W) * Vec(r.scale);
            if (r.softcap > 0.f) s = (s / Vec(r.softcap)).tanh() * Vec(r.softcap);
            if (tile < W) s = Vec::set(Vec(-std::numeric_limits<float>::infinity()), s, tile);  // past the row: no weight
            s.store(score.data() + g * padded + p0);
          }
        }
        for (int64_t g = 0; g < group; ++g) {  // the block's max, weights and their sum, in vectors
          float* s = score.data() + g * padded;
          Vec m = Vec::loadu(s);
          for (int64_t p0 = W; p0 < count; p0 += W) m = at::vec::maximum(m, Vec::loadu(s + p0));
          const float new_max = std::max(run_max[g], at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, m));
          const float keep = std::exp(run_max[g] - new_max);
          Vec total(0.f);
          for (int64_t p0 = 0; p0 < count; p0 += W) {
            const Vec e = (Vec::loadu(s + p0) - Vec(new_max)).exp();
            e.store(s + p0);
            total = total + e;
          }
          const float added = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
          run_sum[g] = run_sum[g] * keep + added;
          run_max[g] = new_max;
          for (int c = 0; c < C; ++c) acc[g * C + c] = acc[g * C + c] * Vec(keep);
        }
        for (int64_t p = 0; p < count; ++p) {
          Vec v[C];
          for (int c = 0; c < C; ++c) v[c] = load_f(r.v_pool + base + p * dim + c * W);
          for (int64_t g = 0; g < group; ++g) {
            const Vec w(score[g * padded + p]);
            for (int c = 0; c < C; ++c) acc[g * C + c] = at::vec::fmadd(w, v[c], acc[g * C + c]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        float tmp[W];
        T* op = r.out + (n * r.heads + h * group + g) * dim;
        for (int c = 0; c < C; ++c) {
          (acc[g * C + c] * Vec(inv)).store(tmp);
          for (int i = 0; i < W; ++i) op[c * W + i] = static_cast<T>(tmp[i]);
        }
      }
    }
  });
}

template <typename T>
void decode_rows(const Rows<T>& r) {
  constexpr int W = Vec::size();
#define HETSERVE_DECODE_VEC(C)                                       \
  if (r.dim == (C) * W) {                                             \
    switch (r.heads / r.kv_heads) {                                   \
      case 1: return decode_rows_vec<T, C, 1>(r);                     \
      case 2: return decode_rows_vec<T, C, 2>(r);                     \
      case 4: return decode_rows_vec<T, C, 4>(r);                     \
      default: return decode_rows_vec<T, C, 0>(r);                    \
    }                                                                 \
  }
  // float and bfloat16 rows in vectors; half (rare on a CPU) and double stage their blocks: each
  // dtype's 36 instances of `decode_rows_vec` are a third of the kernel's build time
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    HETSERVE_DECODE_VEC(2)
    HETSERVE_DECODE_VEC(3)
    HETSERVE_DECODE_VEC(4)
    HETSERVE_DECODE_VEC(5)
    HETSERVE_DECODE_VEC(6)
    HETSERVE_DECODE_VEC(8)
    HETSERVE_DECODE_VEC(12)
    HETSERVE_DECODE_VEC(16)
    HETSERVE_DECODE_VEC(32)
  }
#undef HETSERVE_DECODE_VEC
  decode_rows_any<T>(r);
}

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& tables,
                        const at::Tensor& lens, int64_t window, double scale, double softcap,
                        const c10::optional<at::Tensor>& sinks) {
  // query [N, Hq, D]; kv [2, Hkv, NB, B, D] (a layer of the pool); tables [N, W]; lens [N]
  TORCH_CHECK(query.dim() == 3 && kv.dim() == 5 && kv.size(0) == 2, "paged_decode: query [N, Hq, D], kv [2, Hkv, NB, B, D]");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type(), "paged_decode: query and kv must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && kv.stride(4) == 1 && kv.stride(3) == kv.size(4) &&
              kv.stride(2) == kv.size(3) * kv.size(4), "paged_decode: kv blocks must be contiguous [B, D]");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = kv.size(1), block = kv.size(3);
  TORCH_CHECK(kv.size(4) == dim && heads % kv_heads == 0, "paged_decode: head dims or group sizes disagree");
  auto t = tables.to(at::kLong).contiguous();
  auto l = lens.to(at::kLong).contiguous();
  TORCH_CHECK(t.size(0) == rows && l.size(0) == rows, "paged_decode: one table and one length per row");
  at::Tensor s;
  if (sinks.has_value()) s = sinks->to(at::kFloat).contiguous();
  auto out = at::empty({rows, heads, dim}, query.options());
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    const Rows<scalar_t> r{query.data_ptr<scalar_t>(), kv[0].data_ptr<scalar_t>(), kv[1].data_ptr<scalar_t>(),
                           t.data_ptr<int64_t>(), l.data_ptr<int64_t>(), s.defined() ? s.data_ptr<float>() : nullptr,
                           out.data_ptr<scalar_t>(), rows, heads, kv_heads, block, dim, t.size(1), query.stride(0),
                           query.stride(1), kv.stride(1), kv.stride(2), window, static_cast<float>(scale),
                           static_cast<float>(softcap)};
    decode_rows<scalar_t>(r);
  });
  return out;
}

}  // namespace

// called through torch.ops, which releases the GIL while it runs: the worker's HTTP thread goes on
// meanwhile; the kernel is the CPU key's, so a compiled step calls it through its fake (cpu.py)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor kv, Tensor tables, Tensor lens, int window, float scale, float softcap, "
        "Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(hetserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
