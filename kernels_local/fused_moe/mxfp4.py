"""Fused mixture-of-experts over MXFP4 experts (gpt-oss): the grouped GEMM with e2m1 weights decoded
in registers, its torch reference, and the launches the preflight compiles.

`_moe_mxfp4_gemm_kernel` is the grouped GEMM of `fused_moe.py` with K tiles of exactly one scale
block (32 inputs): each tile's bytes are loaded once per input row pair, each input's nibble
decoded into the activations' dtype (exact: every e2m1 value is an fp16 and a bf16), the dot run
on the 16-bit tensor cores (fp32 operands exactly, `ieee`), and its fp32 result multiplied by the
tile's power-of-two scale per output column (exact) before it is added. The activations are never
quantized: W4A16. The torch reference dequantizes an active expert per call, bit for bit what
dequantizing at load computes. The trade-off: every byte is read for two inputs, which costs load
bandwidth from L1, not from memory, and keeps the decode a plain elementwise step. Layout:
`fused_moe_mxfp4`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

from .fp8 import _dot_any
from .fused_moe import (
    _TRITON_DTYPES,
    ACTIVATIONS,
    FusedMoETuning,
    _activate,
    _moe_tile,
    align_pairs,
    runs_triton,
)
from .torch_path import fused_moe_reference

BLOCK = 32  # inputs per e8m0 scale, and the kernel's K tile
_UNSPECIALIZED = ("max_padded", "num_pairs", "top_k")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@triton.jit
def _decode_e2m1(code):
    # e2m1 code (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0) -> fp32, exact: exponent
    # 1..3 as fp32 exponent 127..129 with the mantissa bit at bit 22; exponent 0 is 0 or 0.5
    c = code.to(tl.uint32)
    sign = (c >> 3) << 31
    exp = (c >> 1) & 3
    man = c & 1
    normal = sign | ((exp + 126) << 23) | (man << 22)
    small = sign | (man * (126 << 23))
    return tl.where(exp == 0, small, normal).to(tl.float32, bitcast=True)


@triton.jit
def _decode_e8m0(s):
    # e8m0 exponent s -> 2^(s - 127) in fp32: s as the exponent field (s = 0: 2^-127, fp32's subnormal)
    bits = s.to(tl.uint32) << 23
    return tl.where(s == 0, 5.877471754111438e-39, bits.to(tl.float32, bitcast=True))


@triton.jit
def _load_e2m1(ptrs, shift, mask, dtype: tl.constexpr):
    # each input's nibble of its byte, decoded into the activations' dtype
    return _decode_e2m1((tl.load(ptrs, mask=mask, other=0) >> shift) & 0xF).to(dtype)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _moe_mxfp4_gemm_kernel(
    A,
    W,
    S,
    Bias,
    RouterW,
    Out,
    SORTED_PAIRS,
    BLOCK_EXPERTS,
    NUM_PADDED,
    max_padded,
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_om,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # 1. this program's pairs (their A rows and expert) and output columns (kernels_local/expert_pairs.py `_moe_tile`)
    pid_m, pairs, pair_mask, rows, expert, offs_n, n_mask, offs_k, a_ptrs = _moe_tile(
        A, SORTED_PAIRS, BLOCK_EXPERTS, max_padded, num_pairs, top_k, N, stride_am, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    # 2. blocks past the experts' padded runs have nothing to do
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    # 3. each input's byte and nibble in the expert's weight rows, and their scales
    shift = ((offs_k % 2) * 4).to(tl.uint8)[:, None]  # [BLOCK_K, 1]: low nibble for even inputs
    w_ptrs = (
        W + expert * stride_we + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None]
    )  # [BLOCK_K, BLOCK_N]
    s_ptrs = S + expert * stride_se + offs_n * stride_sn  # [BLOCK_N]: this column block's first scales
    w_mask = n_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 4. march over K one scale block at a time (K is a whole number of blocks): decode, dot, scale
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
        w = _load_e2m1(w_ptrs, shift, w_mask, a.dtype)
        sw = _decode_e8m0(tl.load(s_ptrs, mask=n_mask, other=127))
        acc += _dot_any(a, w) * sw[None, :]
        if ACTIVATION != "none":  # the up rows sit N rows below the gate rows of the same expert
            u = _load_e2m1(w_ptrs + N * stride_wn, shift, w_mask, a.dtype)
            su = _decode_e8m0(tl.load(s_ptrs + N * stride_sn, mask=n_mask, other=127))
            acc_up += _dot_any(a, u) * su[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += 1
    # 5. epilogue: bias, rounded to the output dtype as the reference's linear output is
    if HAS_BIAS:
        b_ptrs = Bias + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != "none":
            acc_up += tl.load(b_ptrs + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Out.dtype.element_ty).to(tl.float32)
    # 6. gate_up: the activation; down: the router weight of each pair
    if ACTIVATION != "none":
        y = _activate(y, acc_up.to(Out.dtype.element_ty).to(tl.float32), alpha, limit, ACTIVATION)
    if ROUTED:
        y *= tl.load(RouterW + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    # 7. store each pair's row at its pair index
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


# -- torch: an active expert dequantized per call ---------------------------------------------------


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight [N, K] in `dtype` from its blocks [N, K/2] and scales [N, K/32]: the exact
    fp32 product rounded once."""
    b = blocks.to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # [N, K], low nibble first
    values = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)[codes]
    s = scales.to(torch.int32)
    scale = torch.where(s == 0, torch.tensor(2.0**-127, device=s.device), (s << 23).view(torch.float32))
    return (values * scale.repeat_interleave(BLOCK, dim=1)).to(dtype)


class DequantizedExperts:
    """Stacked MXFP4 experts read as `FusedMoE`'s weight tensor: `[e]` is expert e's weight in `dtype`,
    dequantized when asked (the grouping asks only for the experts that received pairs)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        self.shape = (blocks.shape[0], blocks.shape[1], blocks.shape[2] * 2)

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[e], self.scales[e], self.dtype)


def fused_moe_mxfp4_reference(x: torch.Tensor, experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              row_tile: int | None = None) -> torch.Tensor:  # fmt: skip
    """`fused_moe_reference` over the experts dequantized into x's dtype: what dequantizing them at load
    and running the torch `FusedMoE` computes, bit for bit."""
    w1 = DequantizedExperts(experts.w_gate_up_blocks, experts.w_gate_up_scales, x.dtype)
    w2 = DequantizedExperts(experts.w_down_blocks, experts.w_down_scales, x.dtype)
    return fused_moe_reference(x, w1, w2, topk_ids, topk_weights, experts.b_gate_up, experts.b_down,
                               experts.activation, experts.alpha, experts.limit, row_tile)  # fmt: skip


# -- the wrapper -----------------------------------------------------------------------------------


def mxfp4_gemm_ints(hidden: int, intermediate: int, gate_up: bool) -> tuple[tuple[str, int], ...]:
    """(name, value) of the integer arguments N .. stride_om of one GEMM over contiguous blocks and scales."""
    h, i = hidden, intermediate
    n, k = (i, h) if gate_up else (h, i)  # gate_up: x [T, H] -> act [P, I]; down: act [P, I] -> [P, H]
    rows = 2 * i if gate_up else h  # weight rows of one expert
    return (("N", n), ("K", k), ("stride_am", k), ("stride_we", rows * k // 2), ("stride_wn", k // 2),
            ("stride_se", rows * k // BLOCK), ("stride_sn", k // BLOCK), ("stride_be", rows),
            ("stride_om", n))  # fmt: skip


def launch_shape(tuning: FusedMoETuning, tokens: int, dtype: str):
    """The tuning's shape for `tokens` with K tiles of one scale block (32) and, for tiles of 64 rows or
    more, at most 32 columns: gate and up each hold a scaled dot result beside their accumulator."""
    cfg = replace(tuning.launch_shape(tokens, dtype), block_k=BLOCK)
    return cfg if cfg.block_m < 64 else replace(cfg, block_n=min(cfg.block_n, 32))


def _check(x: torch.Tensor, experts) -> None:
    e, two_i, half_h = experts.w_gate_up_blocks.shape
    h, i = x.shape[1], two_i // 2
    want = {"w_gate_up_blocks": (e, 2 * i, h // 2), "w_gate_up_scales": (e, 2 * i, h // BLOCK),
            "w_down_blocks": (e, h, i // 2), "w_down_scales": (e, h, i // BLOCK)}  # fmt: skip
    for name, shape in want.items():
        t = getattr(experts, name)
        if t.dtype != torch.uint8 or tuple(t.shape) != shape or h % BLOCK or i % BLOCK:
            raise ValueError(f"MXFP4 experts of hidden {h} and intermediate {i} (whole blocks of {BLOCK}) store "
                             f"`{name}` uint8 {list(shape)}; got `{t.dtype}` {list(t.shape)}")  # fmt: skip
    if x.dtype not in _TRITON_DTYPES:
        raise TypeError(
            f"MXFP4 experts run on activations of {', '.join(map(str, _TRITON_DTYPES))}; got `{x.dtype}`"
        )
    if experts.activation not in ACTIVATIONS:
        raise ValueError(
            f"Unknown expert activation `{experts.activation}`. Supported: {', '.join(ACTIVATIONS)}"
        )


def fused_moe_mxfp4(x: torch.Tensor, experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                    tuning: FusedMoETuning) -> torch.Tensor:  # fmt: skip
    """The MXFP4 experts of `x` [T, H] -> [T, H] in x's dtype: two launches of the grouped GEMM with
    e2m1 weights decoded in registers; the torch reference on CPU tensors.

    `experts` (the model's `Mxfp4FusedMoE`) carries them as the checkpoint stores them, in our row
    order (gate rows then up rows): `w_gate_up_blocks` [E, 2I, H/2] and `w_down_blocks` [E, H, I/2]
    uint8, two e2m1 codes a byte (input 2j of a row in the low nibble of byte j, 2j+1 in the high
    one), and `w_gate_up_scales` [E, 2I, H/32], `w_down_scales` [E, H, I/32] uint8, one e8m0 exponent
    per 32 inputs of a row: weight (e, n, k) is `e2m1(code[e, n, k]) * 2^(scale[e, n, k // 32] - 127)`.
    It also names `b_gate_up`, `b_down`, `activation`, `alpha`, `limit` and `row_tile`, as `FusedMoE`
    does."""
    _check(x, experts)
    if not runs_triton(x) or x.shape[0] == 0:
        return fused_moe_mxfp4_reference(x, experts, topk_ids, topk_weights)
    (t, h), (e, two_i, _), k = x.shape, experts.w_gate_up_blocks.shape, topk_ids.shape[1]
    p, i = t * k, two_i // 2
    cfg = launch_shape(tuning, t, _TRITON_DTYPES[x.dtype])
    # 1. pairs sorted by expert, each expert's run padded to whole blocks
    sorted_pairs, block_experts, num_padded = align_pairs(topk_ids, e, cfg.block_m)
    max_padded = sorted_pairs.numel()
    router = topk_weights.to(x.dtype).flatten().contiguous()
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)  # [P, I]
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)  # [P, H]
    b1, b2 = experts.b_gate_up, experts.b_down
    steps = ((x.contiguous(), experts.w_gate_up_blocks, experts.w_gate_up_scales, b1, act, True),
             (act, experts.w_down_blocks, experts.w_down_scales, b2, out, False))  # fmt: skip
    # 2. gate_up with the activation fused, then down with bias and router weights
    for a, w, s, bias, y, gate_up in steps:
        ints = dict(mxfp4_gemm_ints(h, i, gate_up))
        grid = (max_padded // cfg.block_m * triton.cdiv(ints["N"], cfg.block_n),)
        _moe_mxfp4_gemm_kernel[grid](
            a, w.contiguous(), s.contiguous(), y if bias is None else bias.contiguous(), router, y, sorted_pairs,
            block_experts, num_padded, max_padded, p, k if gate_up else 1, *ints.values(), float(experts.alpha),
            float(experts.limit), ACTIVATION=experts.activation if gate_up else "none", HAS_BIAS=bias is not None,
            ROUTED=not gate_up, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    # 3. the sum over each token's K experts
    return out.view(t, k, h).sum(dim=1) if k > 1 else out


# -- ahead-of-time compile specs -------------------------------------------------------------------


def mxfp4_compile_specs(tuning: FusedMoETuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `fused_moe_mxfp4` makes with `tuning`: per token bucket, gate_up for each activation
    and down, with and without biases, on uint8 blocks and scales and 16-bit (or fp32) activations."""
    t, index, u8 = pointer(workload.dtype), pointer("i32"), pointer("u8")
    widths = [w for w in workload.widths if w % BLOCK == 0] or [BLOCK]  # MXFP4 rows are whole blocks
    dims = dict.fromkeys((*(int_arg(v) for _, v in mxfp4_gemm_ints(h, i, gate_up)), gate_up)
                         for h in widths for i in widths for gate_up in (True, False))  # fmt: skip
    specs = []
    for m in workload.token_counts():
        cfg = launch_shape(tuning, m, workload.dtype)
        blocks = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k),
                  ("GROUP_M", cfg.group_m))  # fmt: skip
        for *types, gate_up in dims:
            names = [n for n, _ in mxfp4_gemm_ints(BLOCK, BLOCK, gate_up)]
            args = (("A", t), ("W", u8), ("S", u8), ("Bias", t), ("RouterW", t), ("Out", t),
                    ("SORTED_PAIRS", index), ("BLOCK_EXPERTS", index), ("NUM_PADDED", index),
                    *((n, "i32") for n in _UNSPECIALIZED), *zip(names, types, strict=True), ("alpha", "fp32"),
                    ("limit", "fp32"))  # fmt: skip
            for has_bias in (False, True):
                for activation in ACTIVATIONS if gate_up else ("none",):
                    constexprs = (("ACTIVATION", activation), ("HAS_BIAS", has_bias), ("ROUTED", not gate_up),
                                  *blocks)  # fmt: skip
                    specs.append(CompileSpec(_moe_mxfp4_gemm_kernel, args, constexprs, cfg.num_warps, cfg.num_stages,
                                             dot=None if workload.dtype == "fp32" else "f16"))  # fmt: skip
    return unique(specs)
