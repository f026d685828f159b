// The rotary embedding on the CPU in one pass (kernels_local/rotary/cpu.py says why and how it is built).
//
// `apply_rotary`'s torch form (rotate_half layout) is four products, a difference, a sum and a
// concatenation, each a pass through memory over a step's [T, heads, D] queries and keys. Here each
// token's heads are read once and the rotated heads written once, with the torch form's own
// rounding: every product, the difference and the sum are rounded to the input's dtype in turn
// (float32 or bfloat16), so the output is the torch form's bit for bit. A partial rotary (its
// first R of D dimensions) copies the rest through. Tokens are shared among torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kTokensPerTask = 16;  // tokens a thread takes at a time

// The value as the input's dtype holds it: bfloat16 rounds, float32 stays.
inline Vec held(const Vec& v, float) { return v; }
inline Vec held(const Vec& v, at::BFloat16) {
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(v, v)));
}
inline float held(float v, float) { return v; }
inline float held(float v, at::BFloat16) { return static_cast<float>(at::BFloat16(v)); }

// Vec::size() values of T at p, as float32 (`count` of them where fewer remain).
inline Vec load(const float* p, int64_t count) { return Vec::loadu(p, count); }
inline Vec load(const at::BFloat16* p, int64_t count) {
  return std::get<0>(at::vec::convert_to_float<at::BFloat16>(bVec::loadu(p, count)));
}
inline void store(const Vec& v, float* p, int64_t count) { v.store(p, count); }
inline void store(const Vec& v, at::BFloat16* p, int64_t count) {
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, count);
}

// One head: out[:h] = x1 * cos - x2 * sin, out[h:2h] = x2 * cos + x1 * sin, out[2h:] = x[2h:]
template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t half, int64_t dim) {
  const T tag{};
  for (int64_t j = 0; j < half; j += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), half - j);
    const Vec x1 = load(x + j, n), x2 = load(x + half + j, n), c = load(cos + j, n), s = load(sin + j, n);
    store(held(held(x1 * c, tag) - held(x2 * s, tag), tag), out + j, n);
    store(held(held(x2 * c, tag) + held(x1 * s, tag), tag), out + half + j, n);
  }
  for (int64_t j = 2 * half; j < dim; ++j) out[j] = x[j];
}

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = cos.size(-1);
  const int64_t sx = x.stride(0), sh = x.stride(1), sc = cos.stride(0), ss = sin.stride(0);
  const T *xp = x.data_ptr<T>(), *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(xp + t * sx + h * sh, cp + t * sc, sp + t * ss, op + (t * heads + h) * dim, half, dim);
  });
}

}  // namespace

// x [T, heads, D] (each head contiguous), cos and sin [T, 1, R/2] (each row contiguous), R <= D
// -> the rotated x [T, heads, D], contiguous
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x [T, heads, D] with contiguous heads expected, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == 1 &&
                  2 * cos.size(2) <= x.size(2) && cos.stride(2) == 1 && sin.stride(2) == 1 &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin [T, 1, R/2] of x's dtype with R <= D expected, got ", cos.sizes(), " and ",
              sin.sizes(), " for x ", x.sizes());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rotate<at::BFloat16>(x, cos, sin, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary: float32 or bfloat16 expected, got ", x.scalar_type());
    rotate<float>(x, cos, sin, out);
  }
  return out;
}

// torch.ops.hetserve_cpu.rotary (light headers: a build of seconds, not of half a minute)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) { m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor", &rotary); }
