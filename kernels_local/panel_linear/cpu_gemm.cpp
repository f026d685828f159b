// A CPU projection through oneDNN's batch-reduce GEMM kernel (torch's cpublas::brgemm) on a weight
// laid out for it once (kernels_local/panel_linear/cpu.py says why and how it is built and checked).
//
// The weight [N, K] is held transposed, [K, N], as column panels of kPanel columns (the last one
// narrower) one after another: each [K, w] in float32, [K/2, w, 2] in bfloat16 (pairs of K side by
// side, the VNNI order the bfloat16 dot instructions read). Each panel is one contiguous stream,
// multiplied with the rows in blocks of kRowBlock by one brgemm call; the kernel, JIT-compiled by
// oneDNN once per shape, is looked up without the per-call setup of a packed oneDNN matmul. The
// sums are float32; the bias is added to them and a bfloat16 output rounded once, as oneDNN's
// packed matmul does, tile by tile while the tile is in cache: a bfloat16 product goes through a
// [64, 64] float32 tile per call, never a whole float32 output and a second pass to round it (that
// pass was half of a [2048, 1376] projection's time inside a 16-prompt prefill step).
// From kParallelBlocks row blocks on (a prompt's rows) the blocks are shared among torch's
// intra-op threads; each output element is computed whole by one thread, so the result does not
// depend on how many there are.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>

namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kRowBlock = 64;
constexpr int64_t kParallelBlocks = 4;  // from 256 rows the blocks are shared among the threads

using Vec = at::vec::Vectorized<float>;

// A tile's float32 sums [mb, w] (row stride `ldt`) plus the bias (float32, or null) -> the output's
// rows (row stride `ldo`) in bfloat16, rounded once to nearest even as torch's conversion does.
void store_bf16(const float* tile, int64_t ldt, int64_t mb, int64_t w, const float* bias, at::BFloat16* out,
                int64_t ldo) {
  constexpr int64_t kLanes = Vec::size();
  for (int64_t r = 0; r < mb; ++r) {
    const float* t = tile + r * ldt;
    at::BFloat16* o = out + r * ldo;
    int64_t j = 0;
    for (; j + 2 * kLanes <= w; j += 2 * kLanes) {
      Vec a = Vec::loadu(t + j), b = Vec::loadu(t + j + kLanes);
      if (bias != nullptr) {
        a = a + Vec::loadu(bias + j);
        b = b + Vec::loadu(bias + j + kLanes);
      }
      at::vec::convert_from_float<at::BFloat16>(a, b).store(o + j);
    }
    for (; j < w; ++j) o[j] = at::BFloat16(bias != nullptr ? t[j] + bias[j] : t[j]);
  }
}

// The float32 output's tile [mb, w] (row stride `ldo`) plus the bias, in place.
void add_bias(float* out, int64_t ldo, int64_t mb, int64_t w, const float* bias) {
  for (int64_t r = 0; r < mb; ++r) {
    float* o = out + r * ldo;
    int64_t j = 0;
    for (; j + Vec::size() <= w; j += Vec::size()) (Vec::loadu(o + j) + Vec::loadu(bias + j)).store(o + j);
    for (; j < w; ++j) o[j] += bias[j];
  }
}

}  // namespace

// rows [R, K] @ panels (the weight [N, K] as above) + bias [N] -> [R, N] in the rows' dtype
at::Tensor panel_linear(const at::Tensor& rows, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias) {
  const at::Tensor a = rows.contiguous();
  const bool vnni = panels.dim() == 3;
  TORCH_CHECK(a.dim() == 2, "panel_linear: rows [R, K] expected");
  const int64_t m = a.size(0), k = a.size(1), n = panels.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.scalar_type() == a.scalar_type() &&
                  (vnni ? a.scalar_type() == at::kBFloat16 && panels.size(0) * 2 == k && panels.size(2) == 2
                        : a.scalar_type() == at::kFloat && panels.dim() == 2 && panels.size(0) == k),
              "panel_linear: float32 rows with a [K, N] layout or bfloat16 rows with a [K/2, N, 2] one expected, got ",
              a.scalar_type(), " rows ", a.sizes(), " and ", panels.scalar_type(), " panels ", panels.sizes());
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "panel_linear: a bias of ", n, " values expected, got ",
              bias->sizes());
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, a.options());
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  // the row blocks [b0, b1) against every panel: 1. each panel once, 2. each of those blocks against it,
  // 3. its sums plus the bias into the output while they are in cache (bfloat16: from a float32 tile)
  auto run = [&](int64_t b0, int64_t b1) {
    float tile[kRowBlock * kPanel];
    for (int64_t n0 = 0; n0 < n; n0 += kPanel) {
      const int64_t w = std::min(kPanel, n - n0);
      const float* bn = bp == nullptr ? nullptr : bp + n0;
      for (int64_t m0 = b0 * kRowBlock; m0 < std::min(m, b1 * kRowBlock); m0 += kRowBlock) {
        const int64_t mb = std::min(kRowBlock, m - m0);
        if (vnni) {
          at::native::cpublas::brgemm(mb, w, k, k, w, w, false, a.data_ptr<at::BFloat16>() + m0 * k,
                                      panels.data_ptr<at::BFloat16>() + n0 * k, tile, true);
          store_bf16(tile, w, mb, w, bn, out.data_ptr<at::BFloat16>() + m0 * n + n0, n);
        } else {
          float* c = out.data_ptr<float>() + m0 * n + n0;
          at::native::cpublas::brgemm(mb, w, k, k, w, n, false, a.data_ptr<float>() + m0 * k,
                                      panels.data_ptr<float>() + n0 * k, c, false);
          if (bn != nullptr) add_bias(c, n, mb, w, bn);
        }
      }
    }
    at::native::cpublas::brgemm_release(vnni);
  };
  // 4. a prompt's many rows split over torch's intra-op threads (each output element is the same
  // kernel's sum whichever thread computes it); a decode step's few stay on the calling thread
  if (blocks >= kParallelBlocks && at::get_num_threads() > 1) {
    at::parallel_for(0, blocks, 1, run);
  } else {
    run(0, blocks);
  }
  return out;
}

// called through torch.ops, which releases the GIL while it runs: the worker's HTTP thread goes on
// meanwhile; the kernel is the CPU key's, so a compiled step calls it through its fake (cpu.py)
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) { m.def("panel_linear(Tensor rows, Tensor panels, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(hetserve_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
