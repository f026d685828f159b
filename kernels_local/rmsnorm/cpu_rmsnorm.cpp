// RMSNorm on the CPU in one pass per row (kernels_local/rmsnorm/cpu.py says why and how it is built).
//
// The torch reference (`rms_norm_reference`) runs seven passes over a [T, H] input: the float32
// copy, the squares, their mean, the reciprocal root, the product, the copy back and the weight's
// product, each through memory. Here a row is read once, its squares summed in float32 vectors,
// and each element normalized, rounded to the input dtype (as the reference does before the
// weight), multiplied by the weight and rounded again, all while the row is in cache. The math is
// the reference's; only the order of the sum of squares is this kernel's own (float32 rounding of
// the variance may differ in its last bit). Rows are shared among torch's intra-op threads.

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
constexpr int64_t kRowsPerTask = 16;  // rows a thread takes at a time

// 1. the row's sum of squares in float32
float sum_squares(const float* x, int64_t h) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= h; j += Vec::size()) {
    const Vec v = Vec::loadu(x + j);
    acc = acc + v * v;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; j < h; ++j) s += x[j] * x[j];
  return s;
}

float sum_squares(const at::BFloat16* x, int64_t h) {
  Vec acc0(0.f), acc1(0.f);
  int64_t j = 0;
  for (; j + bVec::size() <= h; j += bVec::size()) {
    auto [a, b] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(x + j));
    acc0 = acc0 + a * a;
    acc1 = acc1 + b * b;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc0 + acc1);
  for (; j < h; ++j) {
    const float v = static_cast<float>(x[j]);
    s += v * v;
  }
  return s;
}

// 2. y = w * (x * r), each product rounded as the reference rounds it
void scale_row(const float* x, const float* w, float r, float* y, int64_t h) {
  const Vec rv(r);
  int64_t j = 0;
  for (; j + Vec::size() <= h; j += Vec::size()) (Vec::loadu(w + j) * (Vec::loadu(x + j) * rv)).store(y + j);
  for (; j < h; ++j) y[j] = w[j] * (x[j] * r);
}

void scale_row(const at::BFloat16* x, const at::BFloat16* w, float r, at::BFloat16* y, int64_t h) {
  const Vec rv(r);
  int64_t j = 0;
  for (; j + bVec::size() <= h; j += bVec::size()) {
    auto [x0, x1] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(x + j));
    auto [w0, w1] = at::vec::convert_to_float<at::BFloat16>(bVec::loadu(w + j));
    // the normalized value rounded to bfloat16 first (`h.to(input_dtype)`), then the weight's product
    auto [h0, h1] = at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(x0 * rv, x1 * rv));
    at::vec::convert_from_float<at::BFloat16>(w0 * h0, w1 * h1).store(y + j);
  }
  for (; j < h; ++j) {
    const float hn = static_cast<float>(at::BFloat16(static_cast<float>(x[j]) * r));
    y[j] = at::BFloat16(static_cast<float>(w[j]) * hn);
  }
}

template <typename T>
void rms_rows(const T* x, int64_t ldx, const T* w, T* y, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * ldx;
      const float var = sum_squares(xr, h) / static_cast<float>(h);
      scale_row(xr, w, 1.f / std::sqrt(var + eps), y + r * h, h);
    }
  });
}

}  // namespace

// x [R, H] (rows of any stride, each contiguous), weight [H] of x's dtype -> [R, H] contiguous
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: rows [R, H] with contiguous rows expected, got ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "rms_norm: a contiguous weight of ", x.size(1), " values in ", x.scalar_type(), " expected, got ",
              weight.scalar_type(), " ", weight.sizes());
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor y = at::empty({rows, h}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rms_rows(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
             rows, h, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: float32 or bfloat16 expected, got ", x.scalar_type());
    rms_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), y.data_ptr<float>(), rows, h,
             static_cast<float>(eps));
  }
  return y;
}

// torch.ops.hetserve_cpu.rms_norm (light headers: a build of seconds, not of half a minute)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm); }
