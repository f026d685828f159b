"""fp8 linear layers of pre-quantized checkpoints: the block-scaled native GEMM, the weight-only
(W8A16) GEMM, their torch references, and the two execution wrappers.

The weight arrives as the checkpoint stored it, in one scale layout for every scheme:
`weight_scale` [ceil(N / group_n), ceil(K / group_k)] fp32, weight (n, k) being `q[n, k] *
scale[n // group_n, k // group_k]` (per-tensor and per-channel: one value per row, group_k = K;
128 x 128 blocks: group_n = group_k = 128, or group_n = 1 where fused parts did not start on a
block). `w8a8_linear` (native, sm_89+ and CDNA3/CDNA4) quantizes the activations on the fly;
`w8a16_linear` (weight-only, sm_80/sm_86 and ROCm without fp8 matrix cores) decodes the bytes in
registers and never quantizes the activations. The trade-off of the weight-only GEMM: a decode
per weight tile, hidden behind the loads when a decode step is bound by the weight bytes (the case
it is for), while the bytes stay one per weight in memory. On CPU tensors each runs its torch path.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

from .fp8_linear import _INTERPRETED, SM80, Fp8LinearTuning, _decode_e4m3, compile_specs, runs_triton
from .fp8_linear import _fp8_linear_kernel as _per_row_kernel
from .quant import (
    checkpoint_quantize_specs,
    decode,
    get_format,
    quantize_groups,
    quantize_groups_triton,
    quantize_rows,
    quantize_rows_triton,
    quantize_static,
    quantize_static_triton,
)

BLOCK_GROUP = 128  # columns per activation scale and per weight block of the block-wise format
# The interpreter multiplies bf16 dot operands as raw bits; under it, bf16 dots upcast (exact).
_INTERPRETER_BF16_FIX = tl.constexpr(_INTERPRETED)
# Runtime integers compiled once for every value (a decode step's M of 1, a per-row scale's stride of 1).
_UNSPECIALIZED_BLOCK = ("M", "group_n", "stride_sa", "stride_sw")
_UNSPECIALIZED_W8A16 = ("M", "group_n", "group_k", "stride_sw")


@triton.jit
def _dot16(a, b, acc):
    # fp32 operands: exact products, fp32 sums (never tf32); fp16/bf16: tensor cores
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    if _INTERPRETER_BF16_FIX:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=_UNSPECIALIZED_BLOCK)
def _fp8_block_gemm_kernel(
    A,
    SA,
    W,
    SW,
    B,
    Y,
    M,
    N,
    K,
    stride_am,
    stride_sa,
    stride_wn,
    stride_sw,
    stride_ym,
    group_n,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1. this program's output tile; BLOCK_K is the block width, so one K tile is one scale group
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 2. march over the K blocks: fp8 dot, scaled by the token group's and the weight block's scale
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + k[:, None], mask=(k[:, None] < K) & n_mask[None, :], other=0.0)
        sa = tl.load(SA + offs_m * stride_sa + kb, mask=m_mask, other=0.0)
        sw = tl.load(SW + (offs_n // group_n) * stride_sw + kb, mask=n_mask, other=0.0)
        acc += tl.dot(a, w) * sa[:, None] * sw[None, :]
    # 3. epilogue: the bias, stored in the activation dtype
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=_UNSPECIALIZED_W8A16)
def _fp8_w8a16_kernel(
    A,
    W,
    SW,
    B,
    Y,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_sw,
    stride_ym,
    group_n,
    group_k,
    FNUZ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1. this program's output tile (BLOCK_K divides the scale groups' width when it is below K)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 2. march over K: decode the weight bytes into the activations' dtype, a 16-bit (or IEEE fp32) dot
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        wb = tl.load(W + offs_n[None, :] * stride_wn + k[:, None], mask=(k[:, None] < K) & n_mask[None, :], other=0)
        w = _decode_e4m3(wb, FNUZ).to(a.dtype)
        part = _dot16(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        # 3. the tile's scales: one per output row and K group
        sw = tl.load(SW + (offs_n // group_n) * stride_sw + k0 // group_k, mask=n_mask, other=0.0)
        acc += part * sw[None, :]
    # 4. epilogue: the bias, stored in the activation dtype
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# -- torch references ------------------------------------------------------------------------------


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int, fmt: str) -> torch.Tensor:
    """Weight values [N, K] fp32: each byte's value (uint8 storage decoded, or an fp8 tensor) times its
    group's scale."""
    n, k = qweight.shape
    q = decode(qweight, fmt) if qweight.dtype == torch.uint8 else qweight.to(torch.float32)
    s = scale.to(torch.float32)
    s = s.repeat_interleave(group_n, dim=0) if group_n > 1 else s
    s = s.repeat_interleave(group_k, dim=1) if group_k < k else s
    return q * s[:n, :k]


def w8a16_reference(x, qweight, weight_scale, group_n, group_k, bias, fmt: str) -> torch.Tensor:
    """Weight-only: the dequantized weight in x's dtype, then x's own matmul."""
    w = dequantize(qweight, weight_scale, group_n, group_k, fmt).to(x.dtype)
    return F.linear(x, w, bias)


def _quantized_input(x2, activations, input_scale, group, fmt):
    if activations == "dynamic_group":
        return quantize_groups(x2, fmt, group)
    if activations == "static_tensor":
        return quantize_static(x2, input_scale, fmt)
    return quantize_rows(x2, fmt)


def w8a8_reference(x, qweight, weight_scale, group_n, group_k, input_scale, activations, bias, fmt: str):
    """Native: activations onto the grid as the scheme says, both operands dequantized, fp32 matmul."""
    k = x.shape[-1]
    grid, sx = _quantized_input(x.reshape(-1, k), activations, input_scale, group_k, fmt)  # [M, K], [M, G]
    a = grid * (sx.repeat_interleave(group_k, dim=1)[:, :k] if activations == "dynamic_group" else sx)
    w_t = dequantize(qweight, weight_scale, group_n, group_k, fmt).t().contiguous()  # [K, N]
    y = a @ w_t
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def _scaled_mm_rows(x, qweight, weight_scale, input_scale, activations, bias, fmt):
    """Per-row weight scales on CPU, e4m3fn: `torch._scaled_mm` on the quantized operands."""
    k = x.shape[-1]
    grid, sx = _quantized_input(x.reshape(-1, k), activations, input_scale, None, fmt)
    y = torch._scaled_mm(grid.to(qweight.dtype), qweight.t(), scale_a=sx.contiguous(),
                         scale_b=weight_scale.to(torch.float32).reshape(1, -1), out_dtype=x.dtype,
                         bias=None if bias is None else bias.to(x.dtype))  # fmt: skip
    return y.reshape(*x.shape[:-1], qweight.shape[0])


# -- wrappers --------------------------------------------------------------------------------------


def block_tuning(tuning: Fp8LinearTuning) -> Fp8LinearTuning:
    """The block GEMM's tiles: the family's tuning with one K tile per 128-column block."""
    return replace(tuning, name=f"{tuning.name}-block", block_k=BLOCK_GROUP)


def w8a8_linear(x, qweight, weight_scale, group_n, group_k, input_scale, activations, bias, *, fmt: str,
                tuning: Fp8LinearTuning) -> torch.Tensor:  # fmt: skip
    """Native execution: x [..., K] -> [..., N] in x's dtype.

    Per-row weight scales go through the per-channel GEMM of `fp8_linear.py` (`_fp8_linear_kernel`,
    `NATIVE=True`), after the per-token quantizer or the static one (the checkpoint's
    `input_scale`). Blocks go through `_fp8_block_gemm_kernel`: activations quantized per token and
    128 columns, K marched one block at a time, each block's fp8 dot (fp32) scaled by its
    token-group scale and its weight-block scale before it is added, as DeepSeek's reference GEMM
    does. On CPU tensors (simulated devices): `torch._scaled_mm` for e4m3fn per-row scales (as the
    `--quantize fp8` layer does), the reference otherwise."""
    if qweight.dtype != get_format(fmt).torch_dtype:
        raise TypeError(f"native fp8 weight has dtype `{qweight.dtype}`; the {fmt} convention stores "
                        f"`{get_format(fmt).torch_dtype}`")  # fmt: skip
    k, n = x.shape[-1], qweight.shape[0]
    block = activations == "dynamic_group"
    if not runs_triton(x) or x.numel() == 0:
        if not block and fmt == "e4m3fn" and not x.is_cuda:
            return _scaled_mm_rows(x, qweight, weight_scale, input_scale, activations, bias, fmt)
        return w8a8_reference(x, qweight, weight_scale, group_n, group_k, input_scale, activations, bias, fmt)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    b = bias if bias is not None else out
    if block:
        # 1. activations per token and 128 columns, 2. one launch of the block-scaled GEMM
        a, sa = quantize_groups_triton(x2, fmt, group_k, qweight.dtype)
        bm, bn, bk, warps, stages = block_tuning(tuning).launch_shape(m)
        s = weight_scale.contiguous()
        _fp8_block_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            a, sa, w, s, b, out, m, n, k, a.stride(0), sa.stride(0), w.stride(0), s.stride(0), out.stride(0),
            group_n, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)
    # 1. activations per token, or with the static scale, 2. the per-channel GEMM (NATIVE=True)
    if activations == "static_tensor":
        a, sa = quantize_static_triton(x2, input_scale, fmt, qweight.dtype)
    else:
        a, sa = quantize_rows_triton(x2, fmt, qweight.dtype)
    bm, bn, bk, warps, stages = tuning.launch_shape(m)
    _per_row_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        a, w, sa.reshape(-1).contiguous(), weight_scale.reshape(-1).contiguous(), b, out,
        m, n, k, a.stride(0), w.stride(0), out.stride(0),
        NATIVE=True, FNUZ=fmt == "e4m3fnuz", HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def w8a16_linear(x, qweight, weight_scale, group_n, group_k, bias, *, fmt: str,
                 tuning: Fp8LinearTuning = SM80) -> torch.Tensor:  # fmt: skip
    """Weight-only execution: x [..., K] -> [..., N] in x's dtype, the weight as uint8 bytes.

    The bytes are decoded in registers into the activations' dtype (exact: every e4m3 value is a
    bf16 and an fp16); each K tile's dot runs on 16-bit tensor cores (fp32 operands: IEEE dots) and
    is scaled by its group's scales as it is added. The reference on CPU tensors."""
    if qweight.dtype != torch.uint8:
        raise TypeError(f"weight-only fp8 stores uint8 bytes, got `{qweight.dtype}`")
    k, n = x.shape[-1], qweight.shape[0]
    if not runs_triton(x) or x.numel() == 0:
        return w8a16_reference(x, qweight, weight_scale, group_n, group_k, bias, fmt)
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    s = weight_scale.contiguous()
    bm, bn, bk, warps, stages = w8a16_launch(tuning, m, x.dtype)
    _fp8_w8a16_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x2, w, s, bias if bias is not None else out, out, m, n, k, x2.stride(0), w.stride(0), s.stride(0),
        out.stride(0), group_n, group_k, FNUZ=fmt == "e4m3fnuz", HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def w8a16_launch(tuning: Fp8LinearTuning, m: int, dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the tuning's, K tiles of at most 64 (they divide a
    128-column block; 32 under 64-row tiles, whose decoded weights otherwise spill registers on sm_80)
    and, for fp32 activations (FMA dots on 4-byte operands), tiles of at most 32 x 64."""
    bm, bn, bk, warps, stages = tuning.launch_shape(m)
    bk = min(bk, 32 if bm >= 64 else 64)  # a 64 x 64 tile decoded in fp32 on top of its 64-wide K spilled on sm_80
    if dtype in (torch.float32, "fp32"):
        bm, bn = min(bm, 32), min(bn, 64)
    return bm, bn, bk, warps, stages


# -- ahead-of-time compile specs -------------------------------------------------------------------


def w8a8_specs(tuning: Fp8LinearTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `w8a8_linear` makes with `tuning`: the per-channel GEMM and per-token quantizer of
    `--quantize fp8` (the same launches), the static quantizer, and the block GEMM with its group
    quantizer, per token bucket and bias."""
    fp8, t = workload.fp8_type, workload.dtype
    specs = list(compile_specs(tuning, workload, native=True))
    specs += checkpoint_quantize_specs(workload, fp8, None) + checkpoint_quantize_specs(workload, fp8, BLOCK_GROUP)
    for dim in dict.fromkeys(int_arg(w) for w in workload.widths):
        for m in workload.token_counts():
            bm, bn, bk, warps, stages = block_tuning(tuning).launch_shape(m)
            for has_bias in (False, True):
                args = (("A", pointer(fp8)), ("SA", pointer("fp32")), ("W", pointer(fp8)), ("SW", pointer("fp32")),
                        ("B", pointer(t)), ("Y", pointer(t)), ("M", "i32"), ("N", dim), ("K", dim),
                        ("stride_am", dim), ("stride_sa", "i32"), ("stride_wn", dim), ("stride_sw", "i32"),
                        ("stride_ym", dim), ("group_n", "i32"))  # fmt: skip
                consts = (("HAS_BIAS", has_bias), ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk))
                specs.append(CompileSpec(_fp8_block_gemm_kernel, args, consts, warps, stages, dot="fp8"))
    return unique(specs)


def w8a16_specs(tuning: Fp8LinearTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `w8a16_linear` makes with `tuning`: the W8A16 GEMM per token bucket and bias."""
    t = workload.dtype
    specs = []
    for dim in dict.fromkeys(int_arg(w) for w in workload.widths):
        for m in workload.token_counts():
            bm, bn, bk, warps, stages = w8a16_launch(tuning, m, t)
            for has_bias in (False, True):
                args = (("A", pointer(t)), ("W", pointer("u8")), ("SW", pointer("fp32")), ("B", pointer(t)),
                        ("Y", pointer(t)), ("M", "i32"), ("N", dim), ("K", dim), ("stride_am", dim),
                        ("stride_wn", dim), ("stride_sw", "i32"), ("stride_ym", dim), ("group_n", "i32"),
                        ("group_k", "i32"))  # fmt: skip
                consts = (("FNUZ", workload.fp8_fmt == "e4m3fnuz"), ("HAS_BIAS", has_bias), ("BLOCK_M", bm),
                          ("BLOCK_N", bn), ("BLOCK_K", bk))  # fmt: skip
                specs.append(CompileSpec(_fp8_w8a16_kernel, args, consts, warps, stages,
                                         dot=None if t == "fp32" else "f16"))  # fmt: skip
    return unique(specs)
