"""fp8 (e4m3) linear: y = x @ W.T + b with per-token activation scales and per-output-channel
weight scales, as one Triton kernel, its torch reference, and per-architecture tuning.

Activations are quantized per token in fp32 onto the e4m3 grid (`quant.py`, one fused kernel on
GPUs); the weight arrives quantized in the worker's convention. One tiled GEMM serves both
conventions through the constexpr `NATIVE`, which the caller passes from the value that also chose
the weight buffer's dtype: `NATIVE=True` runs `tl.dot` on fp8 tensor cores (sm_89+, CDNA3 with
e4m3fnuz); `NATIVE=False` (emulated) decodes uint8 bytes to fp16 in registers and runs the dot in
fp16 on grid values. Both accumulate in fp32 and apply `scale_x[m] * scale_w[n]` in the epilogue;
every e4m3 value is exact in fp16 and every product of two exact in fp32, so the two differ only
by summation order. The trade-off of per-token scales: one extra pass over the activations per
linear, for accuracy close to bf16 on outlier tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

from .quant import decode, get_format, quantize_rows, quantize_rows_triton, quantize_specs


@triton.jit
def _decode_e4m3(q, FNUZ: tl.constexpr):
    # 1. split the byte into sign, 4-bit exponent and 3-bit mantissa
    b = q.to(tl.uint32)
    sign = b >> 7
    exp = (b >> 3) & 0xF
    man = b & 0x7
    if FNUZ:
        bias = 8
        sub_step = 0.0009765625  # 2**-10
    else:
        bias = 7
        sub_step = 0.001953125  # 2**-9
    # 2. normals: re-bias the exponent into fp32 bits, mantissa on top (exact)
    bits = (sign << 31) | ((exp + (127 - bias)) << 23) | (man << 20)
    normal = bits.to(tl.float32, bitcast=True)
    # 3. subnormals: mantissa times the smallest spacing 2**(-bias - 2)
    sub = man.to(tl.float32) * sub_step * (1.0 - 2.0 * sign.to(tl.float32))
    # 4. every e4m3 value is exact in fp16, the tensor cores' operand type
    return tl.where(exp == 0, sub, normal).to(tl.float16)


@triton.jit(do_not_specialize=("M",))  # a step's token count: one compiled variant for every value
def _fp8_linear_kernel(
    A,
    W,
    SA,
    SW,
    B,
    Y,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_ym,
    NATIVE: tl.constexpr,
    FNUZ: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1. this program's output tile [BLOCK_M, BLOCK_N]
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 2. march over K; the weight tile is read K-major ([BLOCK_K, BLOCK_N] of W[N, K])
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a_mask = (offs_m[:, None] < M) & (k[None, :] < K)
        w_mask = (k[:, None] < K) & (offs_n[None, :] < N)
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        # 3. fp8 tensor cores, or decode the bytes and use fp16 ones; fp32 accumulation
        if NATIVE:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a, _decode_e4m3(w, FNUZ), acc)
    # 4. epilogue: per-token scale x per-channel scale, then the bias
    sa = tl.load(SA + offs_m, mask=offs_m < M, other=0.0)
    sw = tl.load(SW + offs_n, mask=offs_n < N, other=0.0)
    y = acc * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    # 5. store in the activation dtype
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty), mask=y_mask)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """The torch math: quantize x per token, dequantize both operands, fp32 matmul, bias, cast.
    `qweight` [N, K] is uint8 bytes (emulated) or an fp8 tensor (native); same values either way."""
    k = x.shape[-1]
    grid, sx = quantize_rows(x.reshape(-1, k), fmt)  # [M, K], [M, 1]
    w = decode(qweight, fmt) if qweight.dtype == torch.uint8 else qweight.to(torch.float32)  # [N, K]
    # [K, N] materialized, as torch._scaled_mm does on CPU: the same BLAS call, the same bits
    w_t = (w * weight_scale.to(torch.float32)[:, None]).t().contiguous()
    y = (grid * sx) @ w_t  # [M, N]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def scaled_mm_cpu(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """Native path on CPU tensors: `torch._scaled_mm` on fp8 operands (e4m3fn), which dequantizes both
    operands and multiplies in fp32; the reference does the same steps in the same order, so on CPU
    the native and emulated paths give identical bits."""
    k = x.shape[-1]
    grid, sx = quantize_rows(x.reshape(-1, k), fmt)  # [M, K], [M, 1]
    y = torch._scaled_mm(
        grid.to(qweight.dtype),  # exact: already on the grid
        qweight.t(),  # [K, N], column-major as _scaled_mm wants
        scale_a=sx,
        scale_b=weight_scale.to(torch.float32)[None, :],  # [1, N]
        bias=None if bias is None else bias.to(x.dtype),
        out_dtype=x.dtype,
    )
    return y.reshape(*x.shape[:-1], qweight.shape[0])


@dataclass(frozen=True)
class Fp8LinearTuning:
    """GEMM tile shape per architecture family (BLOCK_M follows the token count)."""

    name: str
    block_n: int
    block_k: int
    max_block_m: int
    num_warps: int
    num_stages: int
    min_block_m: int = 16  # tl.dot needs >= 16 rows; Hopper's wgmma and Blackwell's tcgen05 want 64

    def launch_shape(self, m: int) -> tuple[int, int, int, int, int]:
        """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `m` tokens."""
        block_m = max(self.min_block_m, min(self.max_block_m, triton.next_power_of_2(m)))
        return block_m, self.block_n, self.block_k, self.num_warps, self.num_stages


# Ampere (emulated): fp16 mma, 3-stage cp.async pipeline in 164 KiB of shared memory.
SM80 = Fp8LinearTuning("sm80", block_n=64, block_k=64, max_block_m=64, num_warps=4, num_stages=3)
# Ada (native): fp8 mma wants K tiles of 32+; ~100 KiB shared memory keeps 3 stages.
SM89 = Fp8LinearTuning("sm89", block_n=64, block_k=128, max_block_m=64, num_warps=4, num_stages=3)
# Hopper+ (native): wgmma over 228 KiB shared memory: wider N tiles, 4 stages, 8 warps. Tiles
# of at least 64 rows even for a decode step: below that Triton falls back from wgmma (and
# Blackwell's tcgen05) to an fp16 mma on upcast operands.
SM90 = Fp8LinearTuning("sm90", block_n=128, block_k=128, max_block_m=128, num_warps=8, num_stages=4, min_block_m=64)
# CDNA: 64-lane wavefronts, the AMD backend's stream pipeliner prefers 2 stages.
ROCM = Fp8LinearTuning("rocm", block_n=64, block_k=64, max_block_m=64, num_warps=4, num_stages=2)
TUNINGS = {t.name: t for t in (SM80, SM89, SM90, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_fp8_linear_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def check_weight(qweight: torch.Tensor, native: bool, fmt: str) -> None:
    """The weight buffer must be in the convention the flag says: fp8 dtype iff native."""
    want = get_format(fmt).torch_dtype if native else torch.uint8
    if qweight.dtype != want:
        raise TypeError(
            f"fp8 weight buffer has dtype `{qweight.dtype}` but the convention (native={native}, {fmt}) "
            f"stores `{want}`: buffer and kernel flag must come from the same convention"
        )


def fp8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    native: bool,
    fmt: str,
    tuning: Fp8LinearTuning = SM80,
) -> torch.Tensor:
    """x [..., K] @ dequant(qweight [N, K]).T + bias -> [..., N] in x's dtype."""
    check_weight(qweight, native, fmt)
    if not runs_triton(x) or x.numel() == 0:
        if native and fmt == "e4m3fn":
            return scaled_mm_cpu(x, qweight, weight_scale, bias, fmt)
        return fp8_linear_reference(x, qweight, weight_scale, bias, fmt)
    k, n = x.shape[-1], qweight.shape[0]
    # 1. per-token quantization into the operand the flag's branch expects: fp8 bytes, or
    #    fp16 grid values (both exact)
    a, sx = quantize_rows_triton(x.reshape(-1, k), fmt, qweight.dtype if native else torch.float16)
    # 2. one GEMM launch, NATIVE taken from the caller's convention
    m = a.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
    launch_grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_linear_kernel[launch_grid](
        a, w, sx.reshape(-1).contiguous(), weight_scale.to(torch.float32).contiguous(),
        bias if bias is not None else out, out,
        m, n, k, a.stride(0), w.stride(0), out.stride(0),
        NATIVE=native, FNUZ=fmt == "e4m3fnuz", HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def compile_specs(tuning: Fp8LinearTuning, workload: Workload, *, native: bool) -> tuple[CompileSpec, ...]:
    """Every launch `fp8_linear` makes with `tuning`: the GEMM for each tile height the token
    counts select (with and without bias; N and K are the workload's widths), and the
    per-token quantizer on the widths."""
    fp8 = workload.fp8_type
    a, w = (fp8, fp8) if native else ("fp16", "u8")  # operand types of the NATIVE flag's branch
    specs = []
    for dim in dict.fromkeys(int_arg(n) for n in workload.widths):  # N, K: multiples of 16 or not
        for m in workload.token_counts():
            block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
            for has_bias in (False, True):
                args = (("A", pointer(a)), ("W", pointer(w)), ("SA", pointer("fp32")), ("SW", pointer("fp32")),
                        ("B", pointer(workload.dtype)), ("Y", pointer(workload.dtype)), ("M", "i32"),
                        ("N", dim), ("K", dim), ("stride_am", dim), ("stride_wn", dim), ("stride_ym", dim))  # fmt: skip
                constexprs = (("NATIVE", native), ("FNUZ", workload.fp8_fmt == "e4m3fnuz"), ("HAS_BIAS", has_bias),
                              ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k))  # fmt: skip
                dot = "fp8" if native else "f16"
                specs.append(CompileSpec(_fp8_linear_kernel, args, constexprs, warps, stages, dot=dot))
    return unique(specs) + quantize_specs(workload, a)
