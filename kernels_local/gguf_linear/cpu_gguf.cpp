// GGUF blocks on the CPU: a GEMV over the packed blocks (decode), a matmul on panels of them
// dequantized per call (a prompt's rows), and their exact dequantization; kernels_local/gguf_linear/
// cpu.py says when each runs, how it is built and how it is checked.
//
// The weight is the file's bytes, uint8 [N, K / QK * TYPE_SIZE], llama.cpp's order, never repacked.
// `decode` forms a block's values with gguf-py's own arithmetic (the same float32 products in the
// same order, built with -ffp-contract=off so that no product and difference fuse into one
// rounding): they equal gguf-py's `dequantize` bit for bit. The GEMV takes each output row's blocks
// one at a time, and every activation row (four at a time) its dot product with the block while it
// is in L1, so the packed bytes are read once per call. On AVX2 every type is decoded in registers
// straight into the fused multiply-adds (the K-quants as dl * (q . x) - dm * sum(x), the sums of x
// taken once per call; a block's scales formed eight at a time, its fp16 factors by F16C; where the
// host has AVX-512 the K-quants' codes are widened sixteen at a time, and the int8 GEMV's byte
// multiply-adds take 64 codes an instruction pair with AVX-512BW), elsewhere through a float32
// buffer on the stack. Either way the GEMV
// differs from a float32 matmul on the dequantized weight only in rounding. The output rows are
// shared among torch's intra-op threads, each output element one thread's sum in a fixed order: the
// result depends neither on the thread count nor on the rows beside it in the call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <atomic>
#include <tuple>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// the types decoded here (cpu.py `TYPES` holds the same codes)
enum Type : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4 };
constexpr int64_t kTypes = 5;
constexpr int64_t kQK[kTypes] = {32, 32, 256, 256, 256};
constexpr int64_t kSize[kTypes] = {34, 18, 144, 176, 210};
constexpr int64_t kMaxQK = 256;
constexpr int64_t kRowGrain = 16;  // output rows per task of the intra-op threads
constexpr int64_t kRowChunk = 64;  // output rows a GEMV thread takes at a time

// f(r0, r1) over [0, n) in chunks of `chunk` rows that the intra-op threads take in turn, each the next
// one left, rather than a fixed share each: a thread the OS preempts (the router relaying a token on a
// host whose every core computes) leaves its chunks to the others instead of holding the step back
template <typename F>
void rows_in_turn(int64_t n, int64_t chunk, const F& f) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), chunks));
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // the same exact widening as c10::Half's, one instruction
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---- one block -> QK float32 values, as gguf-py's dequantize forms them ---------------------------
inline void q8_0(const uint8_t* b, float* w) {
  const float d = f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
#pragma omp simd
  for (int l = 0; l < 32; ++l) w[l] = static_cast<float>(q[l]) * d;
}

inline void q4_0(const uint8_t* b, float* w) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
#pragma omp simd
  for (int l = 0; l < 16; ++l) {
    w[l] = d * static_cast<float>((qs[l] & 0x0F) - 8);
    w[l + 16] = d * static_cast<float>((qs[l] >> 4) - 8);
  }
}

// Q4_K / Q5_K's eight 6-bit scales and mins from their 12 bytes
inline void scale_min_k4(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// Q4_K (qh null) and Q5_K: 4 chunks of 64, low nibbles of 32 bytes then their high nibbles, each 32
// with its own scale and min; Q5_K's fifth bit of element 32j + l is bit j of qh[l]
inline void k4(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* w) {
  const float d = f16(b), dmin = f16(b + 2);
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const float dl = d * static_cast<float>(sc[j]), dm = dmin * static_cast<float>(mn[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    float* o = w + 32 * j;
    if (qh == nullptr) {
#pragma omp simd
      for (int l = 0; l < 32; ++l) o[l] = dl * static_cast<float>((q[l] >> shift) & 0x0F) - dm;
    } else {
#pragma omp simd
      for (int l = 0; l < 32; ++l)
        o[l] = dl * static_cast<float>(((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4)) - dm;
    }
  }
}

// Q6_K: two halves of 128; element 128h + 32s + l has its low 4 bits in ql[64h + 32(s % 2) + l]
// (low nibble for s < 2, high for s >= 2) and its top 2 in bits 2s of qh[32h + l]; 16 int8 scales
inline void q6_k(const uint8_t* b, float* w) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
      const uint8_t* hi = qh + 32 * h;
      const int shift = 4 * (s / 2);
      for (int half = 0; half < 2; ++half) {  // 16 elements per scale
        const int e0 = 128 * h + 32 * s + 16 * half;
        const float dl = d * static_cast<float>(scales[e0 / 16]);
#pragma omp simd
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * half + l;
          const int q = (((lo[i] >> shift) & 0x0F) | (((hi[i] >> (2 * s)) & 3) << 4)) - 32;
          w[e0 + l] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

#if defined(__AVX2__)
constexpr bool kVectorDecode = true;

// the 8 signed bytes of `g` (0..3) of a 32-byte vector, each widened to an int32 lane
inline __m256i widen_signed(__m256i v, int g) {
  const __m128i half = g < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  return _mm256_cvtepi8_epi32(g % 2 == 0 ? half : _mm_srli_si128(half, 8));
}

// Q6_K's codes minus 32 as signed bytes, for its 32 values from 128h + 32s: the low 4 bits from
// ql[64h + 32(s % 2) + l] (low nibbles for s < 2, high for s >= 2), the top 2 from bits 2s of qh[32h + l]
inline __m256i q6_k_codes(const uint8_t* b, int h, int s) {
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (s % 2)));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  const __m256i lo = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), _mm256_set1_epi8(3)), 4);
  return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

// a Q4_K / Q5_K block's d * scale_j into `dl` and dmin * min_j into `dm`, j = 0..7: the 6-bit scales
// and mins unpacked from their 12 bytes as 32-bit words (scale_min_k4's bytes), the products those of
// `k4`
inline void k4_scales(const uint8_t* b, float* dl, float* dm) {
  uint32_t u[3];
  std::memcpy(u, b + 4, 12);
  const uint64_t sc = (u[0] & 0x3F3F3F3Fu) | static_cast<uint64_t>((u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
  const uint64_t mn = (u[1] & 0x3F3F3F3Fu) |
                      static_cast<uint64_t>(((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
  const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
  const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
  _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_set1_ps(f16(b)), scf));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), mnf));
}

// a Q6_K block's d * scale for each of its 16 groups of 16 values into `dl`, the products those of `q6_k`
inline void q6_k_scales(const uint8_t* b, float* dl) {
  const __m256 d = _mm256_set1_ps(f16(b + 208));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  _mm256_storeu_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  _mm256_storeu_ps(dl + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
}

// Q4_K and Q6_K as `k4` and `q6_k` form them, eight values per instruction (the same float32
// products in the same order: the values are equal bit for bit)
inline void q4_k_vec(const uint8_t* b, float* w) {
  float dl[8], dm[8];
  k4_scales(b, dl, dm);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256 dlo = _mm256_set1_ps(dl[2 * c]), mlo = _mm256_set1_ps(dm[2 * c]);
    const __m256 dhi = _mm256_set1_ps(dl[2 * c + 1]), mhi = _mm256_set1_ps(dm[2 * c + 1]);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 32 * c + 8 * g)));
      _mm256_storeu_ps(w + 64 * c + 8 * g,
                       _mm256_sub_ps(_mm256_mul_ps(dlo, _mm256_cvtepi32_ps(_mm256_and_si256(v, low4))), mlo));
      _mm256_storeu_ps(w + 64 * c + 32 + 8 * g,
                       _mm256_sub_ps(_mm256_mul_ps(dhi, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))), mhi));
    }
  }
}

inline void q6_k_vec(const uint8_t* b, float* w) {
  float dl[16];
  q6_k_scales(b, dl);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const __m256i q = q6_k_codes(b, h, s);
      const int e0 = 128 * h + 32 * s;
      for (int g = 0; g < 4; ++g) {
        const __m256 ds = _mm256_set1_ps(dl[(e0 + 8 * g) / 16]);
        _mm256_storeu_ps(w + e0 + 8 * g, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(widen_signed(q, g))));
      }
    }
  }
}
#else
constexpr bool kVectorDecode = false;
inline void q4_k_vec(const uint8_t*, float*) {}
inline void q6_k_vec(const uint8_t*, float*) {}
#endif

inline void decode(int64_t type, const uint8_t* b, float* w) {
  switch (type) {
    case kQ8_0: return q8_0(b, w);
    case kQ4_0: return q4_0(b, w);
    case kQ4_K: return kVectorDecode ? q4_k_vec(b, w) : k4(b, nullptr, b + 16, w);
    case kQ5_K: return k4(b, b + 16, b + 48, w);
    default: return kVectorDecode ? q6_k_vec(b, w) : q6_k(b, w);
  }
}

void check(const at::Tensor& q, int64_t type, int64_t k, const char* op) {
  TORCH_CHECK(type >= 0 && type < kTypes, op, ": type code ", type, " is none of 0..", kTypes - 1);
  TORCH_CHECK(k > 0 && k % kQK[type] == 0, op, ": ", k, " inputs are no whole number of blocks of ", kQK[type]);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(1) == k / kQK[type] * kSize[type],
              op, ": contiguous uint8 [N, ", k / kQK[type] * kSize[type], "] blocks expected for ", k,
              " inputs, got ", q.scalar_type(), " ", q.sizes());
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kFused = true;  // every type decoded in registers, straight into the dot products

#if defined(__AVX512F__)
// a 16-lane sum folded to 8 lanes (the K-quants' codes are widened sixteen at a time where the host
// has AVX-512: half the instructions for the same products, summed in another order)
inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// one Q4_K (Q5 false) or Q5_K block against MR rows (`xs`: each row at the block's first input;
// `xsum`: each row's sums of its 32-input groups, the block's first): sum_j dl_j * (q_j . x_j) -
// dm_j * sum(x_j), the codes widened straight from memory, the mins taken once per block from the
// precomputed sums
template <int MR, bool Q5>
inline void k4_rows(const uint8_t* b, const float* const* xs, const float* const* xsum, __m256 (&acc)[MR][2]) {
  float dl[8], dm[8];
  k4_scales(b, dl, dm);
  const uint8_t* qs = b + (Q5 ? 48 : 16);
#if defined(__AVX512F__)
  const __m512i low4 = _mm512_set1_epi32(0x0F), bit = _mm512_set1_epi32(1);
  for (int c = 0; c < 4; ++c) {  // as below, sixteen codes per instruction
    __m512 lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int g = 0; g < 2; ++g) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c + 16 * g)));
      __m512i ql = _mm512_and_si512(v, low4), qh = _mm512_srli_epi32(v, 4);
      if (Q5) {
        const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * g)));
        ql = _mm512_or_si512(ql, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c), bit), 4));
        qh = _mm512_or_si512(qh, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * c + 1), bit), 4));
      }
      const __m512 wl = _mm512_cvtepi32_ps(ql), wh = _mm512_cvtepi32_ps(qh);
      for (int r = 0; r < MR; ++r) {
        lo[r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xs[r] + 64 * c + 16 * g), lo[r]);
        hi[r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xs[r] + 64 * c + 32 + 16 * g), hi[r]);
      }
    }
    const __m256 dlo = _mm256_broadcast_ss(dl + 2 * c), dhi = _mm256_broadcast_ss(dl + 2 * c + 1);
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm256_fmadd_ps(fold(lo[r]), dlo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(fold(hi[r]), dhi, acc[r][1]);
    }
  }
#else
  const __m256i low4 = _mm256_set1_epi32(0x0F), bit = _mm256_set1_epi32(1);
  for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 32 * c + 8 * g)));
      __m256i ql = _mm256_and_si256(v, low4), qh = _mm256_srli_epi32(v, 4);
      if (Q5) {  // Q5_K: the fifth bit of element 32j + l is bit j of qh[l]
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16 + 8 * g)));
        ql = _mm256_or_si256(ql, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * c), bit), 4));
        qh = _mm256_or_si256(qh, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * c + 1), bit), 4));
      }
      const __m256 wl = _mm256_cvtepi32_ps(ql);
      const __m256 wh = _mm256_cvtepi32_ps(qh);
      for (int r = 0; r < MR; ++r) {
        lo[r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xs[r] + 64 * c + 8 * g), lo[r]);
        hi[r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xs[r] + 64 * c + 32 + 8 * g), hi[r]);
      }
    }
    const __m256 dlo = _mm256_broadcast_ss(dl + 2 * c), dhi = _mm256_broadcast_ss(dl + 2 * c + 1);
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm256_fmadd_ps(lo[r], dlo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(hi[r], dhi, acc[r][1]);
    }
  }
#endif
  const __m256 mins = _mm256_loadu_ps(dm);
  for (int r = 0; r < MR; ++r) acc[r][0] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(xsum[r]), acc[r][0]);
}

// one Q6_K block against MR rows: per 16 values, (d * scale) * ((q - 32) . x)
template <int MR>
inline void q6_k_rows(const uint8_t* b, const float* const* xs, __m256 (&acc)[MR][2]) {
  float dl[16];
  q6_k_scales(b, dl);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const __m256i q = q6_k_codes(b, h, s);
      const int e0 = 128 * h + 32 * s;
      for (int half = 0; half < 2; ++half) {  // 16 values per scale: (q - 32) . x, then times d * scale
#if defined(__AVX512F__)
        const __m128i q16 = half == 0 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16));
        const __m256 ds = _mm256_broadcast_ss(dl + (e0 + 16 * half) / 16);
        for (int r = 0; r < MR; ++r)
          acc[r][half] = _mm256_fmadd_ps(fold(_mm512_mul_ps(w, _mm512_loadu_ps(xs[r] + e0 + 16 * half))), ds,
                                         acc[r][half]);
#else
        __m256 t[MR];
        for (int g = 0; g < 2; ++g) {
          const __m256 w = _mm256_cvtepi32_ps(widen_signed(q, 2 * half + g));
          for (int r = 0; r < MR; ++r) {
            const __m256 xr = _mm256_loadu_ps(xs[r] + e0 + 16 * half + 8 * g);
            t[r] = g == 0 ? _mm256_mul_ps(w, xr) : _mm256_fmadd_ps(w, xr, t[r]);
          }
        }
        const __m256 ds = _mm256_broadcast_ss(dl + (e0 + 16 * half) / 16);
        for (int r = 0; r < MR; ++r) acc[r][half] = _mm256_fmadd_ps(t[r], ds, acc[r][half]);
#endif
      }
    }
  }
}

// one Q8_0 (Q4 false: int8 codes) or Q4_0 (nibbles, minus 8) block of 32 against MR rows: d * (q . x),
// Q4_0 as d * (q . x) - 8d * sum(x); the block's parity picks the accumulator (two chains per row)
template <int MR, bool Q4>
inline void small_rows(const uint8_t* b, const float* const* xs, const float* const* xsum, int parity,
                       __m256 (&acc)[MR][2]) {
  const float d = f16(b);
  __m256 s[MR][2];
  for (int r = 0; r < MR; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    __m256 w;
    if (Q4) {  // bytes 8(g % 2).. hold elements 8(g % 2) + l (low nibbles, g < 2) and 16 + 8(g % 2) + l (high)
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * (g % 2))));
      w = _mm256_cvtepi32_ps(g < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(v, 4));
    } else {
      w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * g))));
    }
    for (int r = 0; r < MR; ++r) s[r][g & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[r] + 8 * g), s[r][g & 1]);
  }
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < MR; ++r) {
    __m256 t = _mm256_mul_ps(_mm256_add_ps(s[r][0], s[r][1]), dv);
    if (Q4) t = _mm256_sub_ps(t, _mm256_set_ps(0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 8.f * d * xsum[r][0]));
    acc[r][parity] = _mm256_add_ps(acc[r][parity], t);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// output row `r` for the MR activation rows from `x0` (their group sums from `s0`): its blocks decoded
// in registers
template <int MR>
void fused_row(int64_t type, const uint8_t* row, int64_t blocks, const float* x0, const float* s0, int64_t k,
               float* sums) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const float *xs[MR], *xsum[MR];
  const int64_t qk = kQK[type], size = kSize[type];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int i = 0; i < MR; ++i) xs[i] = x0 + i * k + blk * qk, xsum[i] = s0 + i * (k / 32) + blk * (qk / 32);
    const uint8_t* b = row + blk * size;
    switch (type) {
      case kQ8_0: small_rows<MR, false>(b, xs, xsum, blk & 1, acc); break;
      case kQ4_0: small_rows<MR, true>(b, xs, xsum, blk & 1, acc); break;
      case kQ4_K: k4_rows<MR, false>(b, xs, xsum, acc); break;
      case kQ5_K: k4_rows<MR, true>(b, xs, xsum, acc); break;
      default: q6_k_rows<MR>(b, xs, acc); break;
    }
  }
  for (int i = 0; i < MR; ++i) sums[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
}
#else
constexpr bool kFused = false;
template <int MR>
void fused_row(int64_t, const uint8_t*, int64_t, const float*, const float*, int64_t, float*) {}
#endif

// output row `r` for the MR activation rows from `x0`: each block decoded into `w`, then every row's
// dot product with it (four vector accumulators per row)
template <int MR>
void decoded_row(int64_t type, const uint8_t* row, int64_t blocks, const float* x0, int64_t k, float* sums) {
  constexpr int64_t kLanes = Vec::size();
  const int64_t qk = kQK[type], size = kSize[type];
  alignas(64) float w[kMaxQK];
  Vec acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int a = 0; a < 4; ++a) acc[i][a] = Vec(0.f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    decode(type, row + blk * size, w);
    for (int i = 0; i < MR; ++i) {
      const float* xi = x0 + i * k + blk * qk;
      for (int64_t l = 0; l < qk; l += 4 * kLanes)
        for (int a = 0; a < 4; ++a)
          acc[i][a] = at::vec::fmadd(Vec::loadu(w + l + a * kLanes), Vec::loadu(xi + l + a * kLanes), acc[i][a]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    const Vec sum = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
    sums[i] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  }
}

template <int MR>
void one_row(int64_t type, const uint8_t* row, int64_t blocks, const float* x0, const float* s0, int64_t k,
             float* sums) {
  if (kFused) {
    fused_row<MR>(type, row, blocks, x0, s0, k, sums);
  } else {
    decoded_row<MR>(type, row, blocks, x0, k, sums);
  }
}

// the output rows [r0, r1) of `out` (float32 [M, N]): per output row, the activation rows four at a
// time against its blocks (the row's bytes stay in L1 between the groups)
void gemv_rows(const float* x, const float* xsum, int64_t m, int64_t k, const uint8_t* q, int64_t type,
               const float* bias, float* out, int64_t n, int64_t r0, int64_t r1) {
  const int64_t blocks = k / kQK[type], row_bytes = blocks * kSize[type];
  float sums[4];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * row_bytes;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const float *x0 = x + i0 * k, *s0 = xsum + i0 * (k / 32);
      const int64_t mr = std::min<int64_t>(4, m - i0);
      switch (mr) {
        case 1: one_row<1>(type, row, blocks, x0, s0, k, sums); break;
        case 2: one_row<2>(type, row, blocks, x0, s0, k, sums); break;
        case 3: one_row<3>(type, row, blocks, x0, s0, k, sums); break;
        default: one_row<4>(type, row, blocks, x0, s0, k, sums); break;
      }
      for (int64_t i = 0; i < mr; ++i) out[(i0 + i) * n + r] = bias == nullptr ? sums[i] : sums[i] + bias[r];
    }
  }
}

// ---- the int8 GEMV: activations rounded to 8 bits per 256 inputs, llama.cpp's Q8_K ------------------
// Each activation row is rounded per group of 256 inputs to int8 codes times one float32 step (the
// group's largest magnitude / 127), as llama.cpp rounds its activations for the K-quants; the GEMV is
// then the exact product of the dequantized weight with those rounded rows. A block's codes meet the
// activation codes in byte multiply-adds (`maddubs`: 32 products per instruction) with the block's
// integer sub-scales, in int32 without overflow (|code| <= 128, |scale| <= 127); one float32
// multiply-add per block applies d * step. The mins and Q4_0's offset multiply the rounded rows'
// sums of 32, as in the exact GEMV. Where the host has no AVX2 the exact GEMV runs instead.
constexpr int64_t kGroup = 256;  // inputs per activation step

inline int64_t groups(int64_t k) { return (k + kGroup - 1) / kGroup; }

// x [m, k] -> codes [m, k], steps [m, groups(k)], the rounded rows' sums of 32 [m, k / 32]
void round_rows(const float* x, int64_t m, int64_t k, int8_t* codes, float* steps, float* sums) {
  const int64_t g = groups(k);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < g; ++j) {
      const int64_t l0 = j * kGroup, n = std::min(kGroup, k - l0);
      const float* xi = x + i * k + l0;
      float amax = 0.f;
      for (int64_t l = 0; l < n; ++l) amax = std::max(amax, std::fabs(xi[l]));
      const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      steps[i * g + j] = step;
      int8_t* q = codes + i * k + l0;
      for (int64_t l = 0; l < n; ++l) q[l] = static_cast<int8_t>(std::nearbyint(xi[l] * inv));
      for (int64_t s = 0; s < n; s += 32) {
        int total = 0;
        for (int64_t l = s; l < s + 32; ++l) total += q[l];
        sums[i * (k / 32) + (l0 + s) / 32] = step * static_cast<float>(total);
      }
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kInt8 = true;

inline __m256i codes32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// unsigned weight codes u (0..127) times signed activation codes x, pairs summed to int16, then
// times the int16 scales `s` and pairs summed to int32
inline __m256i dot_u(__m256i u, __m256i x, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), s); }
// signed weight codes w (-128..127) times x: |w| against x with w's sign
inline __m256i dot_s(__m256i w, __m256i x, __m256i s) {
  return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), s);
}

// 64 weight codes (`a` then `b`, 32 each) against the 64 activation codes from `x`, `a`'s pairs times the
// int16 scales `sa` and `b`'s times `sb`, added to `acc`'s int32 lanes: in one 512-bit multiply-add pair
// where the host has AVX-512BW (the integer sums are exact: the same result in another order)
#if defined(__AVX512BW__)
using Isum = __m512i;
inline Isum isum_zero() { return _mm512_setzero_si512(); }
inline __m256i isum_fold(Isum v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
inline __m512i join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline Isum dot64_u(Isum acc, __m256i a, __m256i b, const int8_t* x, __m256i sa, __m256i sb) {
  const __m512i p = _mm512_maddubs_epi16(join(a, b), _mm512_loadu_si512(x));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, join(sa, sb)));
}
inline Isum dot64_s(Isum acc, __m256i a, __m256i b, const int8_t* x, __m256i sa, __m256i sb) {
  const __m512i w = join(a, b), xv = _mm512_loadu_si512(x);  // x negated where w < 0, as `sign` does
  const __m512i xs = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xv);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs), join(sa, sb)));
}
#else
using Isum = __m256i;
inline Isum isum_zero() { return _mm256_setzero_si256(); }
inline __m256i isum_fold(Isum v) { return v; }
inline Isum dot64_u(Isum acc, __m256i a, __m256i b, const int8_t* x, __m256i sa, __m256i sb) {
  return _mm256_add_epi32(acc, _mm256_add_epi32(dot_u(a, codes32(x), sa), dot_u(b, codes32(x + 32), sb)));
}
inline Isum dot64_s(Isum acc, __m256i a, __m256i b, const int8_t* x, __m256i sa, __m256i sb) {
  return _mm256_add_epi32(acc, _mm256_add_epi32(dot_s(a, codes32(x), sa), dot_s(b, codes32(x + 32), sb)));
}
#endif

// one Q4_K (Q5 false) or Q5_K block against MR rows (`xq`: each row's codes at the block's first
// input; `step`: each row's step for them; `xsum`: the rounded rows' sums of 32)
template <int MR, bool Q5>
inline void k4_int8(const uint8_t* b, const int8_t* const* xq, const float* step, const float* const* xsum,
                    __m256 (&acc)[MR][2]) {
  int sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const uint8_t* qs = b + (Q5 ? 48 : 16);
  Isum isum[MR];
  for (int r = 0; r < MR; ++r) isum[r] = isum_zero();
  for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (Q5) {  // the fifth bit of element 32j + l is bit j of qh[l]
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one), 4));
    }
    const __m256i slo = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c]));
    const __m256i shi = _mm256_set1_epi16(static_cast<int16_t>(sc[2 * c + 1]));
    for (int r = 0; r < MR; ++r) isum[r] = dot64_u(isum[r], lo, hi, xq[r] + 64 * c, slo, shi);
  }
  const float d = f16(b), dmin = f16(b + 2);
  float dm[8];
  for (int j = 0; j < 8; ++j) dm[j] = dmin * static_cast<float>(mn[j]);
  const __m256 mins = _mm256_loadu_ps(dm);
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_fold(isum[r])), _mm256_set1_ps(d * step[r]), acc[r][0]);
    acc[r][1] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(xsum[r]), acc[r][1]);
  }
}

// one Q6_K block against MR rows: per 16 values, scale * ((q - 32) . x), times d * step once
template <int MR>
inline void q6_k_int8(const uint8_t* b, const int8_t* const* xq, const float* step, __m256 (&acc)[MR][2]) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  Isum isum[MR];
  for (int r = 0; r < MR; ++r) isum[r] = isum_zero();
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; s += 2) {  // 64 values from 128h + 32s: codes s and s + 1
      const __m256i q0 = q6_k_codes(b, h, s), q1 = q6_k_codes(b, h, s + 1);
      const int e0 = 128 * h + 32 * s, j = e0 / 16;
      const __m256i s0 = _mm256_set_m128i(_mm_set1_epi16(scales[j + 1]), _mm_set1_epi16(scales[j]));
      const __m256i s1 = _mm256_set_m128i(_mm_set1_epi16(scales[j + 3]), _mm_set1_epi16(scales[j + 2]));
      for (int r = 0; r < MR; ++r) isum[r] = dot64_s(isum[r], q0, q1, xq[r] + e0, s0, s1);
    }
  }
  const float d = f16(b + 208);
  for (int r = 0; r < MR; ++r)
    acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_fold(isum[r])), _mm256_set1_ps(d * step[r]), acc[r][0]);
}

// one Q8_0 (Q4 false) or Q4_0 block of 32 against MR rows: d * step * (q . x), Q4_0 less 8d * sum(x)
template <int MR, bool Q4>
inline void small_int8(const uint8_t* b, const int8_t* const* xq, const float* step, const float* const* xsum,
                       int parity, __m256 (&acc)[MR][2]) {
  const float d = f16(b);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i w;
  if (Q4) {  // bytes 0..15: elements l (low nibbles) and 16 + l (high)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low4), _mm_and_si128(v, low4));
  } else {
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
  for (int r = 0; r < MR; ++r) {
    const __m256i x = codes32(xq[r]);
    const __m256i p = Q4 ? dot_u(w, x, ones) : dot_s(w, x, ones);
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * step[r]));
    if (Q4) t = _mm256_sub_ps(t, _mm256_set_ps(0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 8.f * d * xsum[r][0]));
    acc[r][parity] = _mm256_add_ps(acc[r][parity], t);
  }
}

// output row `r` for the MR rounded rows from `q0` (their steps from `d0`, `g` per row; their sums of 32
// from `s0`)
template <int MR>
void int8_row(int64_t type, const uint8_t* row, int64_t blocks, const int8_t* q0, const float* d0, int64_t g,
              const float* s0, int64_t k, float* sums) {
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const int8_t* xq[MR];
  const float* xsum[MR];
  float step[MR];
  const int64_t qk = kQK[type], size = kSize[type];
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t l0 = blk * qk;
    for (int i = 0; i < MR; ++i)
      xq[i] = q0 + i * k + l0, xsum[i] = s0 + i * (k / 32) + l0 / 32, step[i] = d0[i * g + l0 / kGroup];
    const uint8_t* b = row + blk * size;
    switch (type) {
      case kQ8_0: small_int8<MR, false>(b, xq, step, xsum, blk & 1, acc); break;
      case kQ4_0: small_int8<MR, true>(b, xq, step, xsum, blk & 1, acc); break;
      case kQ4_K: k4_int8<MR, false>(b, xq, step, xsum, acc); break;
      case kQ5_K: k4_int8<MR, true>(b, xq, step, xsum, acc); break;
      default: q6_k_int8<MR>(b, xq, step, acc); break;
    }
  }
  for (int i = 0; i < MR; ++i) sums[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

// the output rows [r0, r1) of `out` from the rounded rows, four activation rows at a time per output row
void int8_rows(const int8_t* codes, const float* steps, const float* xsum, int64_t m, int64_t k, const uint8_t* q,
               int64_t type, const float* bias, float* out, int64_t n, int64_t r0, int64_t r1) {
  const int64_t blocks = k / kQK[type], row_bytes = blocks * kSize[type], g = groups(k);
  float sums[4];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * row_bytes;
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
      const int8_t* q0 = codes + i0 * k;
      const float *d0 = steps + i0 * g, *s0 = xsum + i0 * (k / 32);
      const int64_t mr = std::min<int64_t>(4, m - i0);
      switch (mr) {
        case 1: int8_row<1>(type, row, blocks, q0, d0, g, s0, k, sums); break;
        case 2: int8_row<2>(type, row, blocks, q0, d0, g, s0, k, sums); break;
        case 3: int8_row<3>(type, row, blocks, q0, d0, g, s0, k, sums); break;
        default: int8_row<4>(type, row, blocks, q0, d0, g, s0, k, sums); break;
      }
      for (int64_t i = 0; i < mr; ++i) out[(i0 + i) * n + r] = bias == nullptr ? sums[i] : sums[i] + bias[r];
    }
  }
}
#else
constexpr bool kInt8 = false;
void int8_rows(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*,
               float*, int64_t, int64_t, int64_t) {}
#endif

}  // namespace

namespace {

// (M, K, N) of float32 rows x [M, K] against blocks q of `type` for N outputs, and a float32 bias of N
// values or none; a named error otherwise
std::tuple<int64_t, int64_t, int64_t> check_args(const at::Tensor& x, const at::Tensor& q, int64_t type,
                                                 const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": float32 rows [M, K] expected, got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  check(q, type, k, op);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kFloat), op,
              ": a float32 bias of ", n, " values expected");
  return {m, k, n};
}

}  // namespace

// x [M, K] (float32) @ the blocks' weight [N, K].T + bias [N] (float32 or none) -> float32 [M, N]
at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& q, int64_t type, const c10::optional<at::Tensor>& bias) {
  int64_t m, k, n;
  std::tie(m, k, n) = check_args(x, q, type, bias, "gguf_gemv");
  const at::Tensor a = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, a.options());
  const float* xp = a.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  // each row's sums of its 32-input groups (the K-quants' mins and Q4_0's offset multiply them once per block)
  const bool mins = type == kQ4_K || type == kQ5_K || type == kQ4_0;
  const at::Tensor xsum = mins ? a.view({m, k / 32, 32}).sum(-1) : at::empty({m, k / 32}, a.options());  // unread
  const float* sp = xsum.data_ptr<float>();
  rows_in_turn(n, kRowChunk, [&](int64_t r0, int64_t r1) { gemv_rows(xp, sp, m, k, qp, type, bp, op, n, r0, r1); });
  return out;
}

// the blocks [N, K / QK * TYPE_SIZE] -> float32 [N, K], equal to gguf-py's dequantize
at::Tensor gguf_dequantize(const at::Tensor& q, int64_t type, int64_t k) {
  check(q, type, k, "gguf_dequantize");
  const int64_t n = q.size(0), qk = kQK[type], size = kSize[type], blocks = k / qk;
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t blk = 0; blk < blocks; ++blk) decode(type, qp + (r * blocks + blk) * size, op + r * k + blk * qk);
  });
  return out;
}

// x [M, K] (float32) @ the blocks' weight [N, K].T + bias -> float32 [M, N] for a prompt's many rows: the
// weight dequantized kPanel rows at a time into a buffer the calling thread keeps (no fresh pages per
// call, and the panel is in cache when torch's matmul reads it), out.T's rows of the panel by that matmul
at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& q, int64_t type, const c10::optional<at::Tensor>& bias) {
  int64_t m, k, n;
  std::tie(m, k, n) = check_args(x, q, type, bias, "gguf_gemm");
  constexpr int64_t kPanel = 256;
  const int64_t qk = kQK[type], size = kSize[type], blocks = k / qk;
  static thread_local std::vector<float> buffer;
  buffer.resize(std::max<size_t>(buffer.size(), static_cast<size_t>(kPanel * k)));
  const at::Tensor panel = at::from_blob(buffer.data(), {kPanel, k}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor xt = x.t();  // [K, M]
  at::Tensor out_t = at::empty({n, m}, x.options());  // out.T: each panel's rows contiguous
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* bp = buffer.data();
  for (int64_t n0 = 0; n0 < n; n0 += kPanel) {
    const int64_t rows = std::min(kPanel, n - n0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t blk = 0; blk < blocks; ++blk)
          decode(type, qp + ((n0 + r) * blocks + blk) * size, bp + r * k + blk * qk);
    });
    at::Tensor part = out_t.narrow(0, n0, rows);
    at::mm_out(part, panel.narrow(0, 0, rows), xt);
  }
  at::Tensor out = out_t.t().contiguous();
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// x [M, K] (float32) rounded to 8 bits per 256 inputs (the int8 GEMV above) @ the blocks' weight [N, K].T +
// bias -> float32 [M, N]; the exact GEMV where the host has no AVX2
at::Tensor gguf_gemv_int8(const at::Tensor& x, const at::Tensor& q, int64_t type, const c10::optional<at::Tensor>& bias) {
  int64_t m, k, n;
  std::tie(m, k, n) = check_args(x, q, type, bias, "gguf_gemv_int8");
  if (!kInt8) return gguf_gemv(x, q, type, bias);
  const at::Tensor a = x.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor codes = at::empty({m, k}, a.options().dtype(at::kChar));
  at::Tensor steps = at::empty({m, groups(k)}, a.options());
  at::Tensor sums = at::empty({m, k / 32}, a.options());
  round_rows(a.data_ptr<float>(), m, k, codes.data_ptr<int8_t>(), steps.data_ptr<float>(), sums.data_ptr<float>());
  at::Tensor out = at::empty({m, n}, a.options());
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float *dp = steps.data_ptr<float>(), *sp = sums.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  rows_in_turn(n, kRowChunk, [&](int64_t r0, int64_t r1) { int8_rows(cp, dp, sp, m, k, qp, type, bp, op, n, r0, r1); });
  return out;
}

// x [..., K] (any float dtype) @ the blocks' weight [N, K].T + bias -> [..., N] in x's dtype, the
// products in float32: the GEMV below kGemvMaxM rows (`int8`: its rounded rows' variant), the panel
// matmul from there (what a layer calls, eager or from a compiled step)
constexpr int64_t kGemvMaxM = 16;  // cpu.py's GEMV_MAX_M

at::Tensor linear(const at::Tensor& x, const at::Tensor& q, int64_t type, const c10::optional<at::Tensor>& bias,
                  bool int8) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();  // [M, K]
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->to(at::kFloat);
  const at::Tensor out = rows.size(0) >= kGemvMaxM ? gguf_gemm(rows, q, type, b)
                         : int8                    ? gguf_gemv_int8(rows, q, type, b)
                                                   : gguf_gemv(rows, q, type, b);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = q.size(0);
  return out.view(shape).to(x.scalar_type());
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& q, int64_t type, const c10::optional<at::Tensor>& bias) {
  return linear(x, q, type, bias, false);
}

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& q, int64_t type,
                            const c10::optional<at::Tensor>& bias) {
  return linear(x, q, type, bias, true);
}

// whether the int8 GEMV runs here (AVX2), not the exact one in its place
bool gguf_int8() { return kInt8; }

// called through torch.ops, which releases the GIL while it runs: the worker's HTTP thread goes on
// meanwhile; the kernels are the CPU key's, so a compiled step calls them through their fakes (cpu.py)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) {
  m.def("gguf_gemv(Tensor x, Tensor q, int type, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor q, int type, int k) -> Tensor");
  m.def("gguf_gemm(Tensor x, Tensor q, int type, Tensor? bias) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor q, int type, Tensor? bias) -> Tensor");
  m.def("gguf_gemv_int8(Tensor x, Tensor q, int type, Tensor? bias) -> Tensor");
  m.def("gguf_linear_int8(Tensor x, Tensor q, int type, Tensor? bias) -> Tensor");
  m.def("gguf_int8() -> bool", &gguf_int8);  // no tensor to dispatch on: one kernel for every key
}

TORCH_LIBRARY_IMPL(hetserve_cpu, CPU, m) {
  m.impl("gguf_gemv", &gguf_gemv);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_gemm", &gguf_gemm);
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_gemv_int8", &gguf_gemv_int8);
  m.impl("gguf_linear_int8", &gguf_linear_int8);
}
