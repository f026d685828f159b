// The experts of one MoE layer through their oneDNN packs, driven from C++ (cpu_experts.py says
// why and how it is built). It computes what `fused_moe_packed` (torch_path.py) computes, op for
// op: the pairs grouped by expert (a stable counting sort: tokens ascending within each expert),
// each active expert's rows gathered (padded to a multiple of `row_step` past `row_step` rows),
// its gate/up product, the activation, its down product, each pair's output times its router
// weight rounded to the input's dtype and added to its token's row in ascending expert order, in
// float (as `index_add_` adds the sorted pairs). The products and the activation are the same ATen ops;
// only the Python between them is gone (about 30 us an expert on a CPU). Over column panels the
// products run through oneDNN's batch-reduce GEMM (`product`).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

// oneDNN's matmul on a packed weight: mkldnn::_linear_pointwise(x, w, b, "none", [], "")
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b.has_value() ? c10::IValue(*b) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// rows [m, K] times one expert's matrix: a oneDNN pack (its bias inside the product), or the
// matrix [K, N] as the worker lays it out for oneDNN's batch-reduce GEMM kernel, which torch
// exports (cpublas::brgemm: no per-call setup; kernels_local/panel_linear/cpu.py `panels`): column panels
// of `kPanel` columns (the last one narrower) one after the other, each [K, w] in float32 or
// [K/2, w, 2] in bfloat16 (pairs of K side by side, VNNI), so every call streams one contiguous
// panel; rows in blocks of `kRowBlock`. The sums are float32, rounded to bfloat16 once, after the bias.
constexpr int64_t kPanel = 64;
constexpr int64_t kRowBlock = 64;

at::Tensor product(const at::Tensor& rows, const at::Tensor& pack, const c10::optional<at::Tensor>& bias) {
  if (pack.is_mkldnn()) return packed_linear(rows, pack, bias);
  const at::Tensor a = rows.contiguous();
  const bool vnni = pack.dim() == 3;
  const int64_t m = a.size(0), k = a.size(1), n = pack.size(1);
  TORCH_CHECK(pack.is_contiguous() && pack.scalar_type() == a.scalar_type() &&
              (vnni ? a.scalar_type() == at::kBFloat16 && pack.size(0) * 2 == k && pack.size(2) == 2
                    : a.scalar_type() == at::kFloat && pack.dim() == 2 && pack.size(0) == k),
              "experts_packed: a [K, N] float32 or [K/2, N, 2] bfloat16 panel matrix expected");
  at::Tensor out = at::empty({m, n}, a.options().dtype(at::kFloat));
  float* c = out.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n; n0 += kPanel) {
    const int64_t w = std::min(kPanel, n - n0);
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t mb = std::min(kRowBlock, m - m0);
      if (vnni) {
        at::native::cpublas::brgemm(mb, w, k, k, w, n, false, a.data_ptr<at::BFloat16>() + m0 * k,
                                    pack.data_ptr<at::BFloat16>() + n0 * k, c + m0 * n + n0, true);
      } else {
        at::native::cpublas::brgemm(mb, w, k, k, w, n, false, a.data_ptr<float>() + m0 * k,
                                    pack.data_ptr<float>() + n0 * k, c + m0 * n + n0, false);
      }
    }
  }
  if (bias.has_value()) out.add_(*bias);
  return vnni ? out.to(at::kBFloat16) : out;
}

// [n, 2I] gate columns then up columns -> [n, I], as torch_path.py's `expert_activation`
at::Tensor activate(const at::Tensor& h, const std::string& activation, double alpha, double limit) {
  auto halves = h.chunk(2, -1);
  const at::Tensor& gate = halves[0];
  const at::Tensor& up = halves[1];
  if (activation == "silu") return at::silu(gate) * up;
  if (activation == "gelu_tanh") return at::gelu(gate, "tanh") * up;
  at::Tensor g = gate.clamp_max(limit);
  at::Tensor u = up.clamp(-limit, limit);
  return (u + 1) * (g * at::sigmoid(g * alpha));
}

// acc[token] += round(y[row] * w) over one expert's rows: the product rounded to T (as torch's
// mul rounds), the sum in float (as index_add_ accumulates a bfloat16 tensor, rounding once at the end)
template <typename T>
void add_weighted(float* acc, const T* y, const T* weights, const int64_t* pairs, int64_t n, int64_t k,
                  int64_t hidden) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t pair = pairs[r];
    float* dst = acc + (pair / k) * hidden;
    const T* src = y + r * hidden;
    const T w = weights[pair];
    for (int64_t c = 0; c < hidden; ++c) dst[c] += static_cast<float>(static_cast<T>(src[c] * w));  // no FMA
  }
}

}  // namespace

at::Tensor experts_packed(const at::Tensor& x_in, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
                          const c10::optional<at::Tensor>& b_gate_up, const c10::optional<at::Tensor>& b_down,
                          const std::string& activation, double alpha, double limit, int64_t row_step) {
  TORCH_CHECK(x_in.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x_in.size(0),
              "experts_packed: x [T, H] and topk_ids [T, K] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "experts_packed: float32 or bfloat16 expected, got ", x_in.scalar_type());
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(num_experts > 0 && static_cast<int64_t>(down.size()) == num_experts,
              "experts_packed: one gate/up and one down pack per expert expected");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(x.scalar_type()).contiguous();
  const int64_t k = ids.size(1), pairs = ids.numel(), hidden = x.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();

  // 1. a stable counting sort of the pairs by expert
  std::vector<int64_t> starts(num_experts + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "experts_packed: expert id `", id[p], "` outside [0, ",
                num_experts, ")");
    ++starts[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[next[id[p]]++] = p;

  const bool fp32 = x.scalar_type() == at::kFloat;
  at::Tensor acc = at::zeros_like(x, x.options().dtype(at::kFloat));  // [T, H] the sum, in float
  const int64_t row_bytes = hidden * x.element_size();
  const auto* xb = static_cast<const char*>(x.data_ptr());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = starts[e + 1] - starts[e];
    if (n == 0) continue;
    // 2. this expert's rows, zero-padded to a multiple of the step past it (few shapes, few oneDNN kernels)
    const int64_t m = (n > row_step && n % row_step) ? n + row_step - n % row_step : n;
    at::Tensor rows = at::empty({m, hidden}, x.options());
    auto* rb = static_cast<char*>(rows.data_ptr());
    const int64_t* expert_pairs = order.data() + starts[e];
    for (int64_t r = 0; r < n; ++r) std::memcpy(rb + r * row_bytes, xb + (expert_pairs[r] / k) * row_bytes, row_bytes);
    if (m > n) std::memset(rb + n * row_bytes, 0, (m - n) * row_bytes);
    // 3. gate/up, the activation, down (biases inside the products)
    c10::optional<at::Tensor> bgu, bd;
    if (b_gate_up.has_value()) bgu = b_gate_up->select(0, e);
    if (b_down.has_value()) bd = b_down->select(0, e);
    at::Tensor h = product(rows, gate_up[e], bgu);                                    // [m, 2I]
    at::Tensor y = product(activate(h, activation, alpha, limit), down[e], bd).contiguous();  // [m, H]
    // 4. each pair's output times its router weight, added to its token's row
    if (fp32) {
      add_weighted(acc.data_ptr<float>(), y.data_ptr<float>(), weights.data_ptr<float>(), expert_pairs, n, k, hidden);
    } else {
      add_weighted(acc.data_ptr<float>(), y.data_ptr<at::BFloat16>(), weights.data_ptr<at::BFloat16>(),
                   expert_pairs, n, k, hidden);
    }
  }
  if (!gate_up[0].is_mkldnn()) at::native::cpublas::brgemm_release(gate_up[0].dim() == 3);
  return fp32 ? acc : acc.to(x.scalar_type());
}

// called through torch.ops, which releases the GIL while it runs: the worker's HTTP thread goes on meanwhile
TORCH_LIBRARY_FRAGMENT(hetserve_cpu, m) {
  m.def("experts_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] gate_up, Tensor[] down, "
        "Tensor? b_gate_up, Tensor? b_down, str activation, float alpha, float limit, int row_step) -> Tensor",
        &experts_packed);
}
