// Greedy rows on the CPU: each row's argmax under log_softmax and its logprob, without the
// [N, V] logprobs (kernels_local/sampling/cpu.py says why and how it is built and checked).
//
// torch's form writes log_softmax's [N, V] output, then ATen's argmax reads it back one element at
// a time (its CPU argmax is a scalar loop), then a gather picks each row's value. Here each row's
// max and sum of exponentials are ATen's own reductions (`vec::reduce_all`, `vec::map_reduce_all`,
// and the sum's log through `Vectorized::log`, as `serial_vec_log_softmax_lastdim_range` in
// ATen/native/cpu/LogSoftmaxKernelImpl.h computes them), so every logprob `(x - max) - log(sum)` is
// the one log_softmax writes, bit for bit; the argmax is then the first index holding the greatest
// of those values, as ATen's argmax takes it (a NaN above every number: the first NaN where there is
// one), found in vectors. Rows are shared among torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRowsPerTask = 4;  // rows a thread takes at a time

// One row: its argmax under log_softmax and that logprob.
std::pair<int64_t, float> greedy_row(const float* x, int64_t v) {
  // 1. log_softmax's max, sum of exponentials and the sum's log, as ATen computes them
  const float max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, v);
  const float sum = at::vec::map_reduce_all<float>([max](Vec a) { return (a - Vec(max)).exp(); },
                                                   [](Vec a, Vec b) { return a + b; }, x, v);
  float lanes[Vec::size()];
  Vec(sum).log().store(lanes);
  const float lsum = lanes[0];
  auto logprob = [max, lsum](float a) { return (a - max) - lsum; };
  // 2. the greatest logprob (NaN if any is NaN: `maximum` propagates it)
  const float top = at::vec::map_reduce_all<float>([max, lsum](Vec a) { return (a - Vec(max)) - Vec(lsum); },
                                                   [](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, v);
  // 3. its first index, as ATen's argmax takes it (the first NaN where there is one)
  int64_t j = 0;
  if (std::isnan(top)) {
    for (; j < v; ++j)
      if (std::isnan(logprob(x[j]))) return {j, logprob(x[j])};
  }
  const int all = (1 << Vec::size()) - 1;
  for (; j + Vec::size() <= v; j += Vec::size()) {
    const int equal = ~((Vec::loadu(x + j) - Vec(max)) - Vec(lsum)).eq(Vec(top)).zero_mask() & all;
    if (equal != 0) return {j + __builtin_ctz(equal), top};
  }
  for (; j < v; ++j)
    if (logprob(x[j]) == top) return {j, top};
  return {0, logprob(x[0])};  // unreachable: the maximum is one of the row's values
}

}  // namespace

// logits [N, V] float32 (rows of any stride, each contiguous) -> (ids [N] int64, logprobs [N] float32)
std::tuple<at::Tensor, at::Tensor> greedy(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.size(1) > 0,
              "greedy: float32 logits [N, V] with contiguous rows expected, got ", logits.scalar_type(), " ",
              logits.sizes(), " strides ", logits.strides());
  const int64_t n = logits.size(0), v = logits.size(1), ld = logits.stride(0);
  at::Tensor ids = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor lps = at::empty({n}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::tie(ip[r], lp[r]) = greedy_row(x + r * ld, v);
  });
  return {ids, lps};
}

// torch.ops.hetserve_cpu.greedy (light headers: a build of seconds, not of half a minute)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) { m.def("greedy(Tensor logits) -> (Tensor, Tensor)", &greedy); }
