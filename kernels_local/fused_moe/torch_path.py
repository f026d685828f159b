"""The experts in torch: the reference (one matmul pair per active expert, in fixed tiles under
`--deterministic`) and the CPU path, with the custom op that lets a compiled decode step call it.

Both sort the `T x K` token-expert pairs by expert with one stable sort. The reference loops over
the active experts, reading the pair counts on the host; the CPU path makes one call per
projection however many experts a step touches: `torch._grouped_mm` with one group per expert
(`fused_moe_grouped`), or, where a CPU worker packed the experts, one packed matmul pair per
active expert driven from C++ (`fused_moe_packed`, cpu_experts.py; `packed_wins` chooses). Inside
`torch.compile` the CPU path is one opaque op, `hetserve_fused_moe::grouped_experts`, shaped like
`x`, so the grouping's data-dependent sizes stay inside it and Inductor compiles the rest of the
step around it. The trade-off: nothing around the op fuses into it; the reference stays the
readable statement of the math that the Triton kernel and the CPU path are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_experts

# A CPU worker's oneDNN packs of the stacked expert weights, one per expert, kept on the dense
# tensor under this attribute (workers/model/cpu_projections.py makes them), and oneDNN's matmul.
PACKED_ATTR = "_hetserve_onednn"
# An expert's rows past 8 go to oneDNN padded to a multiple of 8: it compiles one kernel per row
# count, so a worker keeps a few per expert shape, not one per count.
PACKED_ROW_STEP = 8


def expert_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] gate columns then up columns -> [n, I]."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _pairs_by_expert(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """(order, tokens, xs, counts): the `T x K` pairs sorted by expert with one stable sort (tokens
    ascending within each), each pair's token, its row of `x` [P, H], the pairs per expert (host)."""
    flat = topk_ids.flatten()  # [P]
    order = flat.argsort(stable=True)  # [P]
    tokens = order // topk_ids.shape[1]  # [P]
    return order, tokens, x.index_select(0, tokens), torch.bincount(flat, minlength=num_experts).tolist()


def _weighted_sum(x: torch.Tensor, ys: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The sorted pairs' outputs `ys` [P, H] times their router weights (in x's dtype), each token's K rows summed."""
    ys = ys * topk_weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]


def fused_moe_reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                        b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                        limit: float = 7.0, row_tile: int | None = None) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H] in x's dtype: pairs grouped by expert
    (one stable sort), one matmul pair per active expert (in fixed zero-padded tiles of
    `row_tile` rows when set, so a row's result does not depend on its batch mates), router
    weights applied in x's dtype, experts added in ascending order."""
    order, tokens, xs, counts = _pairs_by_expert(x, topk_ids, w_gate_up.shape[0])
    ys = torch.empty_like(xs)  # [P, H]
    start = 0
    for e, n in enumerate(counts):
        tile = row_tile or n
        for lo in range(start, start + n, max(tile, 1)):  # nothing for an expert without pairs
            rows = min(tile, start + n - lo)
            part = xs[lo : lo + rows] if rows == tile else F.pad(xs[lo : lo + rows], (0, 0, 0, tile - rows))
            h = F.linear(part, w_gate_up[e], None if b_gate_up is None else b_gate_up[e])  # [tile, 2I]
            y = F.linear(expert_activation(h, activation, alpha, limit), w_down[e],
                         None if b_down is None else b_down[e])  # fmt: skip
            ys[lo : lo + rows] = y[:rows]
        start += n
    return _weighted_sum(x, ys, order, tokens, topk_weights)


def fused_moe_packed(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                     b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:  # fmt: skip
    """The reference's sum through the experts' oneDNN packs (`PACKED_ATTR` on both stacks, one
    packed matrix per expert): one packed matmul pair per active expert, biases inside it. Driven
    from C++ where that loop builds on the host (cpu_experts.py: the Python loop's ops without the
    Python between them; over column panels where the worker laid an expert's matrices out so,
    kernels_local/panel_linear/cpu.py), from Python otherwise (over oneDNN packs only)."""
    gate_up, down = getattr(w_gate_up, PACKED_ATTR), getattr(w_down, PACKED_ATTR)
    if cpu_experts.load().available:  # the same ops from C++ (cpu_experts.cpp), over packs or panels
        return cpu_experts.experts_packed(x, topk_ids, topk_weights, gate_up, down, b_gate_up, b_down, activation,
                                          alpha, limit, PACKED_ROW_STEP)  # fmt: skip
    order, tokens, xs, counts = _pairs_by_expert(x, topk_ids, w_gate_up.shape[0])
    ys = torch.empty_like(xs)  # [P, H]
    linear = torch.ops.mkldnn._linear_pointwise
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = xs[start : start + n]  # [n, H]
        if n > PACKED_ROW_STEP and n % PACKED_ROW_STEP:  # a multiple of the step: few shapes, few kernels
            rows = F.pad(rows, (0, 0, 0, PACKED_ROW_STEP - n % PACKED_ROW_STEP))
        h = linear(rows, gate_up[e], None if b_gate_up is None else b_gate_up[e], "none", [], "")  # [n', 2I]
        y = linear(expert_activation(h, activation, alpha, limit), down[e], None if b_down is None else b_down[e],
                   "none", [], "")  # fmt: skip
        ys[start : start + n] = y[:n]
        start += n
    return _weighted_sum(x, ys, order, tokens, topk_weights)


def packed_wins(rows_per_expert: float, from_cpp: bool, onednn: bool = True) -> bool:
    """Whether the experts' packed matrices beat the grouped GEMM at this many rows per expert: from
    C++ always; from Python, over oneDNN packs (`onednn`: the Python loop multiplies by nothing else)
    from two rows, below which a oneDNN call's fixed cost outweighs the gain (timings:
    docs/benchmarks.md "Decode step against transformers")."""
    return from_cpp or (onednn and rows_per_expert >= 2)


def fused_moe_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                      b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:  # fmt: skip
    """The reference's sum as two `torch._grouped_mm` calls, one group per expert: [T, H] -> [T, H]
    (through the experts' oneDNN packs where the worker made them). The group ends are a
    scatter-add and a cumsum on the device, so nothing is read on the host. Its results are the
    reference's within fp32 rounding (the same per-expert products; the activation runs over all
    pairs at once, whose vector tail may round an ulp apart: tests/test_kernels_moe.py), and a bias
    is added after the product (`x @ W + b`, as transformers writes it), a rounding apart in bf16."""
    packs = getattr(w_gate_up, PACKED_ATTR, None), getattr(w_down, PACKED_ATTR, None)
    if None not in packs and packed_wins(topk_ids.numel() / w_gate_up.shape[0], cpu_experts.load().available,
                                         packs[0][0].is_mkldnn and packs[1][0].is_mkldnn):  # fmt: skip
        return fused_moe_packed(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation, alpha,
                                limit)  # fmt: skip
    num_experts, k = w_gate_up.shape[0], topk_ids.shape[1]
    flat = topk_ids.flatten().to(torch.int64)  # [P]
    # 1. pairs by expert, and where each expert's run ends (a scatter-add: nothing read on the host)
    order = flat.argsort(stable=True)  # [P]
    experts = flat.index_select(0, order)  # [P] the expert of each sorted pair
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    ends = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)  # [E]
    tokens = order // k  # [P]
    xs = x.index_select(0, tokens)  # [P, H]
    # 2. gate_up, the activation, down: one grouped GEMM per projection, biases per row
    h = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=ends)  # [P, 2I]
    if b_gate_up is not None:
        h = h + b_gate_up.index_select(0, experts)
    y = torch._grouped_mm(expert_activation(h, activation, alpha, limit), w_down.transpose(1, 2), offs=ends)  # [P, H]
    if b_down is not None:
        y = y + b_down.index_select(0, experts)
    # 3. router weights in x's dtype, then each token's K rows summed
    y = y * topk_weights.flatten().index_select(0, order)[:, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)  # [T, H]


def _grouped_experts_op():
    """`hetserve_fused_moe::grouped_experts`, registered once per process (this repository may be
    imported under two names: as `kernels` loads it and as `kernels_local.fused_moe`)."""
    namespace = torch.ops.hetserve_fused_moe
    if hasattr(namespace, "grouped_experts"):
        return namespace.grouped_experts

    @torch.library.custom_op("hetserve_fused_moe::grouped_experts", mutates_args=())
    def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None,
                        b_down: torch.Tensor | None, activation: str, alpha: float,
                        limit: float) -> torch.Tensor:  # fmt: skip
        return fused_moe_grouped(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation,
                                 alpha, limit)  # fmt: skip

    grouped_experts.register_fake(lambda x, *args: torch.empty_like(x))  # [T, H]
    return namespace.grouped_experts


GROUPED_EXPERTS = _grouped_experts_op()


def fused_moe_torch(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                    limit: float = 7.0) -> torch.Tensor:  # fmt: skip
    """The experts without Triton: on CPU tensors the grouped path (as the opaque op inside a
    compiled graph); on a GPU (a device below Triton's floor) the reference, whose per-expert
    cuBLAS calls need no grouped GEMM support from the installed torch."""
    if x.device.type != "cpu":
        return fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation,
                                   alpha, limit)  # fmt: skip
    if torch.compiler.is_compiling():
        return GROUPED_EXPERTS(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation,
                               float(alpha), float(limit))  # fmt: skip
    return fused_moe_grouped(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation, alpha,
                             limit)  # fmt: skip
