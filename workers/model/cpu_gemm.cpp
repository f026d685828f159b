// A CPU projection through oneDNN's batch-reduce GEMM kernel (torch's cpublas::brgemm) on a weight
// laid out for it once (workers/model/cpu_gemm.py says why and how it is built and checked).
//
// The weight [N, K] is held transposed, [K, N], as column panels of kPanel columns (the last one
// narrower) one after another: each [K, w] in float32, [K/2, w, 2] in bfloat16 (pairs of K side by
// side, the VNNI order the bfloat16 dot instructions read). Each panel is one contiguous stream,
// multiplied with the rows in blocks of kRowBlock by one brgemm call; the kernel, JIT-compiled by
// oneDNN once per shape, is looked up without the per-call setup of a packed oneDNN matmul. The
// sums are float32; the bias is added to them and a bfloat16 output rounded once, as oneDNN's
// packed matmul does.
// From kParallelBlocks row blocks on (a prompt's rows) the blocks are shared among torch's
// intra-op threads; each output element is computed whole by one thread, so the result does not
// depend on how many there are.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kRowBlock = 64;
constexpr int64_t kParallelBlocks = 4;  // from 256 rows the blocks are shared among the threads

}  // namespace

// rows [R, K] @ panels (the weight [N, K] as above) + bias [N] -> [R, N] in the rows' dtype
torch::Tensor panel_linear(const torch::Tensor& rows, const torch::Tensor& panels,
                           const c10::optional<torch::Tensor>& bias) {
  const torch::Tensor a = rows.contiguous();
  const bool vnni = panels.dim() == 3;
  TORCH_CHECK(a.dim() == 2, "panel_linear: rows [R, K] expected");
  const int64_t m = a.size(0), k = a.size(1), n = panels.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == a.scalar_type() &&
                  (vnni ? a.scalar_type() == at::kBFloat16 && panels.size(0) * 2 == k && panels.size(2) == 2
                        : a.scalar_type() == at::kFloat && panels.dim() == 2 && panels.size(0) == k),
              "panel_linear: float32 rows with a [K, N] layout or bfloat16 rows with a [K/2, N, 2] one expected, got ",
              a.scalar_type(), " rows ", a.sizes(), " and ", panels.scalar_type(), " panels ", panels.sizes());
  torch::Tensor out = torch::empty({m, n}, a.options().dtype(at::kFloat));
  float* c = out.data_ptr<float>();
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  // the row blocks [b0, b1) against every panel: 1. each panel once, 2. each of those blocks against it
  auto run = [&](int64_t b0, int64_t b1) {
    for (int64_t n0 = 0; n0 < n; n0 += kPanel) {
      const int64_t w = std::min(kPanel, n - n0);
      for (int64_t m0 = b0 * kRowBlock; m0 < std::min(m, b1 * kRowBlock); m0 += kRowBlock) {
        const int64_t mb = std::min(kRowBlock, m - m0);
        if (vnni) {
          at::native::cpublas::brgemm(mb, w, k, k, w, n, false, a.data_ptr<at::BFloat16>() + m0 * k,
                                      panels.data_ptr<at::BFloat16>() + n0 * k, c + m0 * n + n0, true);
        } else {
          at::native::cpublas::brgemm(mb, w, k, k, w, n, false, a.data_ptr<float>() + m0 * k,
                                      panels.data_ptr<float>() + n0 * k, c + m0 * n + n0, false);
        }
      }
    }
    at::native::cpublas::brgemm_release(vnni);
  };
  // 3. a prompt's many rows split over torch's intra-op threads (each output element is the same
  // kernel's sum whichever thread computes it); a decode step's few stay on the calling thread
  if (blocks >= kParallelBlocks && at::get_num_threads() > 1) {
    at::parallel_for(0, blocks, 1, run);
  } else {
    run(0, blocks);
  }
  if (bias.has_value()) out.add_(*bias);  // 4. the bias on the float32 sums, then one rounding
  return vnni ? out.to(at::kBFloat16) : out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL released while it runs: the worker's HTTP thread goes on meanwhile
  m.def("panel_linear", &panel_linear, "a CPU projection by brgemm over column panels",
        py::call_guard<py::gil_scoped_release>());
}
