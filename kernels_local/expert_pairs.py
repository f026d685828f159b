"""Token-expert pairs grouped by expert for a grouped GEMM: what every expert kernel shares (the
fused MoE's, its fp8 and MXFP4 variants', the GGUF experts').

`align_pairs` sorts a step's `T x K` pairs by expert and pads each expert's run to whole blocks on
the device (no host sync); `_moe_tile` is the kernels' common prologue (a program's block of pairs,
their A rows and expert, its output columns); `_activate` the gated activations of their gate_up
epilogue. Infrastructure beside `compile_spec` and `cpp_build`, so each kernel repository that
groups experts stays loadable on its own. The trade-off: padding wastes up to `BLOCK_M - 1` rows per
active expert, for one launch over every active expert and no weight read of an idle one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gelu_tanh(x):
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh from exp(-2|u|) in (0, 1]: no overflow
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return 0.5 * x * (1.0 + tl.where(u < 0, -t, t))


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    # silu(gate) * up; Gemma 4: gelu_tanh(gate) * up; gpt-oss: gate clamped above, up clamped
    # both ways, (up + 1) * glu
    if ACTIVATION == "silu":
        return gate * tl.sigmoid(gate) * up
    if ACTIVATION == "gelu_tanh":
        return _gelu_tanh(gate) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))


@triton.jit
def _moe_tile(A, SORTED_PAIRS, BLOCK_EXPERTS, max_padded, num_pairs, top_k, N, stride_am,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # The prologue every grouped GEMM shares (fused_moe's, its fp8 and MXFP4 ones', the GGUF experts'): this program's
    # block of pairs and of output columns, the pairs' A rows and expert, and the masks.
    # 1. program -> (pair block, column block), GROUP_M pair blocks side by side so that
    #    consecutive programs reuse one expert's weight tile from L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    # 2. this block's pairs (padding slots hold `num_pairs`), their A rows, and their expert: read
    #    for every block of the launch (`SORTED_PAIRS` holds all of them), used by the live ones
    pairs = tl.load(SORTED_PAIRS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    rows = (pairs // top_k).to(tl.int64)
    expert = tl.load(BLOCK_EXPERTS + pid_m).to(tl.int64)
    # 3. the block's output columns and the first K tile of its A rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    return pid_m, pairs, pair_mask, rows, expert, offs_n, n_mask, offs_k, a_ptrs


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Host bound of the aligned length: every active expert pads at most `block_m - 1` slots."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the pairs by expert and pad each expert's run to a multiple of `block_m`, on the
    device: (`sorted_pairs` [max_padded] int32, padding slots hold P; `block_experts`
    [max_padded / block_m] int32; `num_padded` [1] int32, the true padded length)."""
    flat = topk_ids.flatten().to(torch.int64)  # [P]
    p, device = flat.numel(), flat.device
    max_padded = max_padded_pairs(p, num_experts, block_m)
    # 1. pairs per expert (a scatter-add: bincount would read its maximum on the host)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)  # [E] end of each expert's padded run
    # 2. each sorted pair's slot: its expert's padded start plus its rank inside the expert
    order = flat.argsort(stable=True)  # [P]
    expert = flat.index_select(0, order)  # [P]
    rank = torch.arange(p, device=device) - (counts.cumsum(0) - counts).index_select(0, expert)
    slot = (ends - padded).index_select(0, expert) + rank
    sorted_pairs = torch.full((max_padded,), p, dtype=torch.int32, device=device)
    sorted_pairs[slot] = order.to(torch.int32)
    # 3. each block's expert: how many padded runs end at or before the block's start
    blocks = torch.arange(max_padded // block_m, device=device)
    block_experts = torch.searchsorted(ends // block_m, blocks, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), ends[-1:].to(torch.int32)
