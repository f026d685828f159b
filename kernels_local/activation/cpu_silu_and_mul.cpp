// silu(gate) * up on the CPU in one pass (kernels_local/activation/cpu.py says why and how it is built).
//
// The torch reference (`silu_and_mul_reference`) runs SiLU over the strided gate half, writes it,
// then reads it back with the up half for the product. Here each row's gate and up are read once
// and the product written once, with the reference's own math: SiLU as `x / (1 + exp(-x))` in
// float32 (ATen's vectorized `exp` in blocks of two vectors, `std::exp` for the rest of a row, as
// ATen's SiLU kernel does on one thread), rounded to bfloat16 before the product where the input is bfloat16, and the
// product rounded once. Rows are shared among torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kRowsPerTask = 8;  // rows a thread takes at a time

inline Vec silu(const Vec& g) { return g / (Vec(1.f) + g.neg().exp()); }
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// ATen's elementwise loop takes a row in blocks of two vectors and the rest one element at a time
// (with `std::exp`); so does this one, so each element meets the same `exp` as in the reference.
void row(const float* g, const float* u, float* y, int64_t d) {
  constexpr int64_t kBlock = 2 * Vec::size();
  int64_t j = 0;
  for (; j + kBlock <= d; j += kBlock) {
    (silu(Vec::loadu(g + j)) * Vec::loadu(u + j)).store(y + j);
    (silu(Vec::loadu(g + j + Vec::size())) * Vec::loadu(u + j + Vec::size())).store(y + j + Vec::size());
  }
  for (; j < d; ++j) y[j] = silu(g[j]) * u[j];
}

void row(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* y, int64_t d) {
  constexpr int64_t kBlock = 2 * bVec::size();
  int64_t j = 0;
  for (; j + kBlock <= d; j += kBlock) {
    for (int64_t h = j; h < j + kBlock; h += bVec::size()) {
      auto [g0, g1] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(g + h));
      auto [u0, u1] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(u + h));
      // SiLU rounded to bfloat16 first (`F.silu` returns the input's dtype), then the product
      auto [s0, s1] = at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(silu(g0), silu(g1)));
      at::vec::convert_from_float<at::BFloat16>(s0 * u0, s1 * u1).store(y + h);
    }
  }
  for (; j < d; ++j) {
    const float s = static_cast<float>(at::BFloat16(silu(static_cast<float>(g[j]))));
    y[j] = at::BFloat16(s * static_cast<float>(u[j]));
  }
}

template <typename T>
void rows(const T* x, int64_t ldx, T* y, int64_t n, int64_t d) {
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(x + r * ldx, x + r * ldx + d, y + r * d, d);
  });
}

}  // namespace

// x [R, 2I] = cat(gate, up) (rows of any stride, each contiguous) -> [R, I] contiguous
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: rows [R, 2I] with contiguous rows expected, got ", x.sizes(), " strides ", x.strides());
  const int64_t n = x.size(0), d = x.size(1) / 2;
  at::Tensor y = at::empty({n, d}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rows(x.data_ptr<at::BFloat16>(), x.stride(0), y.data_ptr<at::BFloat16>(), n, d);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_and_mul: float32 or bfloat16 expected, got ", x.scalar_type());
    rows(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), n, d);
  }
  return y;
}

// torch.ops.hetserve_cpu.silu_and_mul (light headers: a build of seconds, not of half a minute)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) { m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul); }
