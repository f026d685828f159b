"""GGUF experts: a MoE layer's stacked GGUF blocks through one grouped GEMM per projection, the blocks
decoded in registers, with its torch reference.

llama.cpp stacks each projection of every expert in one tensor ([E, rows, bytes per row]: gate, up and
down, each of one type, as Q4_K_M's Q4_K gate/up and Q6_K down). The pairs of a step are grouped by
expert and each expert's run padded to whole blocks on the device (kernels_local/expert_pairs.py), and
one launch then serves every active expert: a program takes one block of one expert's pairs and a
tile of output columns, decodes that expert's weight tile with gguf_linear.py's `_dequant` (the
element values gguf-py computes, rounded to the activations' dtype) and runs the dot on the tensor
cores with fp32 accumulation. gate_up keeps gate and up accumulators side by side and activates
them in the epilogue; down multiplies each pair's row by its router weight; torch sums over top-k.
Gate and up of different types (two tensors, two types) take one launch each, activated in torch.
The trade-off: at decode a block of 16 rows holds one pair per active expert, so most of the dot's
rows are padding; the weight bytes, read once per active expert and column tile, are the cost that
remains, as for the dense GEMV. `gguf_moe_experts` is the reference (and the CPU's loop, over its
GEMV): one projection per active expert through a given linear, with the kernel's roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique
from kernels_local.expert_pairs import _activate, _moe_tile, align_pairs

from .gguf_linear import _dequant, _dot, _grid_values, _to_operand, runs_triton
from .reference import BLOCKS, check_layout, gguf_linear_reference

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated activations of the GGUF families with experts
_UNSPECIALIZED = ("max_padded", "num_pairs", "top_k")
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _gguf_moe_kernel(A, W, W_UP, GRID, RouterW, Out, SORTED_PAIRS, BLOCK_EXPERTS, NUM_PADDED, max_padded, num_pairs,
                     top_k, N, K, stride_am, stride_we, stride_om, TYPE: tl.constexpr, QK: tl.constexpr,
                     TYPE_SIZE: tl.constexpr, ACTIVATION: tl.constexpr, ROUTED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # 1. this program's pairs (their A rows and expert) and output columns
    pid_m, pairs, pair_mask, rows, expert, offs_n, n_mask, offs_k, a_ptrs = _moe_tile(
        A, SORTED_PAIRS, BLOCK_EXPERTS, max_padded, num_pairs, top_k, N, stride_am, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    # 2. blocks past the experts' padded runs have nothing to do
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    # 3. the byte offset of each output column's row of blocks in the expert's tensor: [1, BLOCK_N]
    row_off = expert * stride_we + offs_n.to(tl.int64)[None, :] * ((K // QK) * TYPE_SIZE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 4. march over K: the pairs' inputs, the expert's weight tile [BLOCK_K, BLOCK_N] decoded in registers
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (k < K)[None, :], other=0.0)
        w_mask = (k[:, None] < K) & n_mask[None, :]
        w = _dequant(W, GRID, row_off, k[:, None], w_mask, TYPE, QK, TYPE_SIZE)
        acc = _dot(a, _to_operand(w, A.dtype.element_ty), acc)
        if ACTIVATION != "none":  # gated: the up tensor has the gate's layout
            u = _dequant(W_UP, GRID, row_off, k[:, None], w_mask, TYPE, QK, TYPE_SIZE)
            acc_up = _dot(a, _to_operand(u, A.dtype.element_ty), acc_up)
        a_ptrs += BLOCK_K
    # 5. epilogue: each product rounded to the activation dtype (as a linear's output), the activation,
    #    the router weight of each pair; stored at the pair's index
    y = acc.to(Out.dtype.element_ty).to(tl.float32)
    if ACTIVATION != "none":
        y = _activate(y, acc_up.to(Out.dtype.element_ty).to(tl.float32), 1.0, 0.0, ACTIVATION)
    if ROUTED:
        y *= tl.load(RouterW + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GGUFMoETuning:
    """Launch shapes per architecture family: up to `decode_tokens` tokens (decode) 16-row blocks of 32
    columns (over 8 warps on CUDA: with 4, Q6_K spills on sm_86..sm_120); more, `prefill_m` x `block_n`
    tiles grouped by 8 for L2 reuse. K tiles of 32 inputs (a simple block, a K-block's sub-block). Each
    program decodes two weight tiles element by element into two fp32 accumulators, and ptxas gives 8
    warps at most 128 registers a thread, so the tiles stay small: wider ones spilled in the preflight
    (64 x 64 on sm_80, any 32-row block over 4 warps on sm_75, 32 x 32 of Q8_0 on sm_100..sm_120, so
    the Hopper-and-later prefill keeps the decode's 16 rows); fp32 operands (FMA dots) take at most
    32 x 32. One stage on CUDA: the weight tiles are gathered byte by byte (no asynchronous copy to
    pipeline), and a second stage's buffers made ptxas spill (sm_86, sm_120)."""

    name: str
    prefill_m: int
    block_n: int
    num_warps: int
    num_stages: int
    decode_warps: int = 8
    decode_tokens: int = 32
    block_k: int = 32

    def launch_shape(self, tokens: int, dtype: str) -> tuple[int, int, int, int, int, int]:
        """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) of a launch over `tokens` tokens."""
        if tokens <= self.decode_tokens:
            return 16, 32, self.block_k, 1, self.decode_warps, self.num_stages
        fp32 = dtype == "fp32"
        block_m, block_n = (min(self.prefill_m, 32), min(self.block_n, 32)) if fp32 else (self.prefill_m, self.block_n)
        return block_m, block_n, self.block_k, 8, self.num_warps, self.num_stages


MOE_SM70 = GGUFMoETuning("sm70", prefill_m=32, block_n=32, num_warps=8, num_stages=1)  # Volta/Turing
MOE_SM80 = GGUFMoETuning("sm80", prefill_m=64, block_n=32, num_warps=8, num_stages=1)  # Ampere/Ada
MOE_SM90 = GGUFMoETuning("sm90", prefill_m=16, block_n=32, num_warps=8, num_stages=1)  # Hopper, Blackwell
MOE_ROCM = GGUFMoETuning("rocm", prefill_m=64, block_n=64, num_warps=4, num_stages=2, decode_warps=4)  # CDNA
MOE_TUNINGS = {t.name: t for t in (MOE_SM70, MOE_SM80, MOE_SM90, MOE_ROCM)}

Linear = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (x [n, K], blocks [N, bytes], type) -> [n, N]


def _gated(h: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """activation(gate) * up in fp32 from outputs rounded to their dtype, rounded once (the kernel's epilogue)."""
    g = h.to(torch.float32)
    g = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    return (g * up.to(torch.float32)).to(h.dtype)


def _check(x, gate, up, down, types, topk_ids, topk_weights, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"Unsupported GGUF expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"GGUF experts take activations in one of {', '.join(map(str, _DTYPES))}; got `{x.dtype}`")
    h, (e, i) = x.shape[-1], gate.shape[:2]
    for name, q, t, rows, k in (("gate", gate, types[0], i, h), ("up", up, types[1], i, h),
                                ("down", down, types[2], h, i)):  # fmt: skip
        if q.dim() != 3 or q.shape[:2] != (e, rows):
            raise ValueError(f"GGUF expert `{name}` blocks must be uint8 [{e}, {rows}, bytes]; got {tuple(q.shape)}")
        check_layout(q[0], t, k)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, K]; got "
                         f"`{tuple(topk_ids.shape)}` and `{tuple(topk_weights.shape)}`")  # fmt: skip


def group_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  types: tuple[str, str, str], topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str,
                  linear: Linear) -> torch.Tensor:  # fmt: skip
    """The experts of `x` [T, H] -> [T, H], one `linear(rows, expert's weight, type)` per active expert and
    projection, the pairs grouped by expert; the grouped kernel's roundings. `gate`, `up`, `down`: [E, ...]
    of whatever `linear` reads (GGUF blocks, or dense weights once dequantized)."""
    (t, h), k = x.shape, topk_ids.shape[1]
    flat = topk_ids.flatten()  # [P]
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    xs = x.index_select(0, order // k)  # [P, H] each sorted pair's token
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)  # [P, H] at each pair's index
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = xs[start:start + n]
            act = _gated(linear(rows, gate[e], types[0]), linear(rows, up[e], types[1]), activation)  # [n, I]
            out[order[start:start + n]] = linear(act, down[e], types[2])  # [n, H]
            start += n
    router = topk_weights.to(x.dtype).flatten().to(torch.float32)[:, None]  # [P, 1], rounded as the kernel's
    out = (out.to(torch.float32) * router).to(x.dtype)
    return out.view(t, k, h).sum(dim=1) if k > 1 else out


def gguf_moe_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     types: tuple[str, str, str], topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     activation: str = "silu", linear: Linear | None = None) -> torch.Tensor:  # fmt: skip
    """`gguf_moe`'s arguments through `group_experts` with `linear` over the blocks (default: the torch
    reference, `gguf_linear_reference`)."""
    _check(x, gate, up, down, types, topk_ids, topk_weights, activation)
    linear = linear or (lambda rows, q, type_name: gguf_linear_reference(rows, q, type_name))
    return group_experts(x, gate, up, down, types, topk_ids, topk_weights, activation, linear)


def gguf_moe(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: tuple[str, str, str],
             topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str = "silu", *,
             tuning: GGUFMoETuning = MOE_SM80) -> torch.Tensor:  # fmt: skip
    """The experts of `x` [T, H] for `topk_ids` / `topk_weights` [T, K] -> [T, H] in x's dtype.

    `gate`, `up`: uint8 [E, I, H / QK * TYPE_SIZE] of `types[0]`, `types[1]`; `down`: uint8
    [E, H, I / QK * TYPE_SIZE] of `types[2]` (each expert's rows as the file stores them). The grouped
    kernel where `runs_triton(x)`, else the reference."""
    if not runs_triton(x) or x.shape[0] == 0:
        return gguf_moe_experts(x, gate, up, down, types, topk_ids, topk_weights, activation)
    _check(x, gate, up, down, types, topk_ids, topk_weights, activation)
    (t, h), (e, i), k = x.shape, gate.shape[:2], topk_ids.shape[1]
    p = t * k
    block_m, block_n, block_k, group_m, warps, stages = tuning.launch_shape(t, _DTYPES[x.dtype])
    sorted_pairs, block_experts, num_padded = align_pairs(topk_ids, e, block_m)
    max_padded, grid_values = sorted_pairs.numel(), _grid_values(x.device)
    router = topk_weights.to(x.dtype).flatten().contiguous()  # [P]

    def launch(a, w, w_up, type_name, n, k_in, y, activation, routed, top_k):
        qk, size = BLOCKS[type_name]
        grid = (max_padded // block_m * triton.cdiv(n, block_n),)
        _gguf_moe_kernel[grid](
            a, w, w_up, grid_values, router, y, sorted_pairs, block_experts, num_padded, max_padded, p, top_k, n,
            k_in, a.stride(0), w.stride(0), y.stride(0), TYPE=type_name, QK=qk, TYPE_SIZE=size, ACTIVATION=activation,
            ROUTED=routed, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip

    x, gate, up, down = x.contiguous(), gate.contiguous(), up.contiguous(), down.contiguous()
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)  # [P, I] at each pair's index
    if types[0] == types[1]:  # 1. gate_up with the activation fused
        launch(x, gate, up, types[0], i, h, act, activation, False, k)
    else:  # gate and up of two types: a launch each, the activation in torch
        g, u = torch.empty_like(act), torch.empty_like(act)
        launch(x, gate, gate, types[0], i, h, g, "none", False, k)
        launch(x, up, up, types[1], i, h, u, "none", False, k)
        act = _gated(g, u, activation)
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)  # [P, H]
    launch(act, down, down, types[2], h, i, out, "none", True, 1)  # 2. down with the router weights
    return out.view(t, k, h).sum(dim=1) if k > 1 else out  # 3. the sum over each token's experts


def moe_compile_specs(tuning: GGUFMoETuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `gguf_moe` makes with `tuning`: per token bucket and type, gate_up with each
    activation (and unactivated, for gate and up of two types) and down, routed."""
    act = pointer(workload.dtype)
    dot = None if workload.dtype == "fp32" else "f16"
    index = pointer("i32")
    specs = []
    for dim in dict.fromkeys(int_arg(n) for n in workload.widths):  # N, K and strides: multiples of 16 or not
        args = (("A", act), ("W", pointer("u8")), ("W_UP", pointer("u8")), ("GRID", pointer("fp32")),
                ("RouterW", act), ("Out", act), ("SORTED_PAIRS", index), ("BLOCK_EXPERTS", index),
                ("NUM_PADDED", index), *((n, "i32") for n in _UNSPECIALIZED),
                *((n, dim) for n in ("N", "K", "stride_am", "stride_we", "stride_om")))  # fmt: skip
        for m in workload.token_counts():
            block_m, block_n, block_k, group_m, warps, stages = tuning.launch_shape(m, workload.dtype)
            blocks = (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k), ("GROUP_M", group_m))
            for type_name in BLOCKS:
                qk, size = BLOCKS[type_name]
                for activation, routed in (*((a, False) for a in ACTIVATIONS), ("none", False), ("none", True)):
                    constexprs = (("TYPE", type_name), ("QK", qk), ("TYPE_SIZE", size), ("ACTIVATION", activation),
                                  ("ROUTED", routed), *blocks)  # fmt: skip
                    specs.append(CompileSpec(_gguf_moe_kernel, args, constexprs, warps, stages, dot=dot))
    return unique(specs)
