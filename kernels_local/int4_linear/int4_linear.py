"""W4A16 linear: y = x @ W.T + b with W dequantized from 4-bit integers inside the GEMM, and its torch
reference.

One run-time layout serves every 4-bit checkpoint format (GPTQ's; the others repack to it at load,
exactly; see `int4_linear`). A tiled GEMM loads a [BLOCK_K, BLOCK_N] tile of words (each word read
for its eight inputs: the cache serves the repeats), unpacks the nibbles in registers, forms
(q - z) * s in fp32 from each input's scale and zero point, rounds it to the scales' dtype (the
reference weight, bit for bit) and then to the activations' dtype, and runs `tl.dot` on those with
fp32 accumulation: the kernel equals the reference up to fp32 summation order. The trade-off: a
gather per input for scales and zero points (simple, act-order for free) instead of one load per
group; the tunings keep BLOCK_K at or below the smallest group, so a tile spans few groups and
those loads stay in cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

SCALE_TYPES = ("fp16", "bf16", "fp32")  # Triton's names of the scale dtypes checkpoints store
GROUPS = (32, 64, 128, 0)  # 0: per channel


# Triton's interpreter (TRITON_INTERPRET=1) multiplies bf16 dot operands as their raw uint16 bits;
# under it, bf16 dots upcast to fp32 first (exact, as a tensor core's products are).
_INTERPRETER_BF16_FIX = tl.constexpr(type(tl.sum).__name__ == "InterpretedFunction")


@triton.jit
def _dot(a, b, acc):
    # fp32 operands: exact products and fp32 sums (no tf32 rounding); fp16/bf16: tensor cores
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    if _INTERPRETER_BF16_FIX:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=("M",))  # a step's token count: one compiled variant for every value
def _int4_linear_kernel(
    A,
    QW,
    S,
    Z,
    GIDX,
    B,
    Y,
    M,
    N,
    K,
    stride_am,
    stride_qk,
    stride_sg,
    stride_ym,
    GROUP,
    ACT_ORDER: tl.constexpr,
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
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a_mask = (offs_m[:, None] < M) & (k[None, :] < K)
        w_mask = (k[:, None] < K) & (offs_n[None, :] < N)
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        # 2. the words holding this tile's inputs, their nibbles unpacked in registers: [BLOCK_K, BLOCK_N]
        words = tl.load(QW + (k // 8)[:, None] * stride_qk + offs_n[None, :], mask=w_mask, other=0)
        q = (words >> ((k % 8) * 4)[:, None]) & 0xF
        # 3. each input's group: act-order's g_idx, or its position (GROUP = K per channel: group 0)
        if ACT_ORDER:
            g = tl.load(GIDX + k, mask=k < K, other=0)
        else:
            g = k // GROUP
        s = tl.load(S + g[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0.0)
        z = tl.load(Z + g[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0).to(tl.int32)
        # 4. (q - z) * s exact in fp32, rounded once to the scales' dtype (the reference weight), then
        #    to the operand dtype of the dot
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        if S.dtype.element_ty == tl.bfloat16:  # round to nearest even on the bits (the interpreter's cast is not)
            bits = w.to(tl.uint32, bitcast=True)
            w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            w = w.to(S.dtype.element_ty)
        w = w.to(A.dtype.element_ty)
        acc = _dot(a, w, acc)
    # 5. epilogue: the bias, then the store in the activation dtype
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=y_mask)


def unpack_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
                  group_size: int, in_features: int) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] in the scales' dtype, as the kernel forms it: (q - z) * s rounded once."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).flatten(0, 1)[:in_features]  # [K, N]
    groups, n = scales.shape
    size = group_size if group_size > 0 else in_features
    if g_idx is None and groups * size == in_features:  # whole groups: broadcast, no per-input gather
        diff = q.view(groups, size, n) - zeros.to(torch.int32)[:, None, :]  # [G, size, N]
        w = (diff.to(torch.float32) * scales.to(torch.float32)[:, None, :]).view(in_features, n)  # exact
        return w.to(scales.dtype).t()
    k = torch.arange(in_features, device=qweight.device)
    g = g_idx.long() if g_idx is not None else (k // group_size if group_size > 0 else k * 0)
    w = (q - zeros.to(torch.int32)[g]).to(torch.float32) * scales.to(torch.float32)[g]  # [K, N], exact
    return w.to(scales.dtype).t()


def int4_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          g_idx: torch.Tensor | None, bias: torch.Tensor | None,
                          group_size: int) -> torch.Tensor:  # fmt: skip
    """The torch math: the weight unpacked and rounded to the scales' dtype, then the activations',
    an fp32 matmul, the bias, the cast. `group_size` 0: per channel."""
    k = x.shape[-1]
    w = unpack_weight(qweight, scales, zeros, g_idx, group_size, k).to(x.dtype).to(torch.float32)  # [N, K]
    y = x.reshape(-1, k).to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


@dataclass(frozen=True)
class Int4LinearTuning:
    """GEMM tile shape per architecture family (BLOCK_M follows the token count; BLOCK_K <= 32, the
    smallest group, so a tile never spans more than two groups)."""

    name: str
    block_n: int
    block_k: int
    max_block_m: int
    num_warps: int
    num_stages: int
    min_block_m: int = 16  # tl.dot needs >= 16 rows

    def launch_shape(self, m: int) -> tuple[int, int, int, int, int]:
        """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `m` tokens."""
        block_m = max(self.min_block_m, min(self.max_block_m, triton.next_power_of_2(m)))
        return block_m, self.block_n, self.block_k, self.num_warps, self.num_stages


# Turing: fp16 mma, 64 KB of shared memory: two stages of small tiles, at most 32 rows (64-row tiles
# over 4 warps spill on sm_75; docs/benchmarks.md "Preflight matrix").
SM75 = Int4LinearTuning("sm75", block_n=64, block_k=32, max_block_m=32, num_warps=4, num_stages=2)
# Ampere / Ada / Blackwell consumer (sm_80..sm_89, sm_120): cp.async pipelining, three stages.
SM80 = Int4LinearTuning("sm80", block_n=64, block_k=32, max_block_m=64, num_warps=4, num_stages=3)
# Hopper and Blackwell data-center: wider N tiles and 8 warps over 227 KB.
SM90 = Int4LinearTuning("sm90", block_n=128, block_k=32, max_block_m=64, num_warps=8, num_stages=3)
# CDNA: 64-lane wavefronts, two stages (the AMD stream pipeliner's preference).
ROCM = Int4LinearTuning("rocm", block_n=64, block_k=32, max_block_m=64, num_warps=4, num_stages=2)
TUNINGS = {t.name: t for t in (SM75, SM80, SM90, ROCM)}

_INTERPRETED = type(_int4_linear_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None, bias: torch.Tensor | None, group_size: int, *,
                tuning: Int4LinearTuning = SM80) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ dequant(qweight [ceil(K/8), N]).T + bias -> [..., N] in x's dtype.

    The layout: `qweight` int32 [ceil(K/8), N] (input 8i+j in bits 4j..4j+3 of row i), `scales`
    [G, N] in the checkpoint's dtype, `zeros` [G, N] integers (int8/uint8, the zero point each group
    subtracts) and, for act-order checkpoints, `g_idx` [K] int32 (each input's group; otherwise the
    group is k // GROUP, a run-time integer, K per channel, so one variant serves every group size).
    The dot runs on fp16 or bf16 tensor cores, fp32 operands in IEEE precision; the bias is added in
    the epilogue. Rounding to bf16 is round-to-nearest-even on the fp32 bits, which the interpreter's
    own cast does not do."""
    if group_size not in GROUPS:
        raise ValueError(f"Unsupported int4 group size `{group_size}`. Supported: {', '.join(map(str, GROUPS))}")
    if qweight.dtype != torch.int32 or zeros.shape != scales.shape:
        raise TypeError(f"int4 weight must be int32 words with zeros shaped like the scales; got `{qweight.dtype}`, "
                        f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)}")
    if not runs_triton(x) or x.numel() == 0:
        return int4_linear_reference(x, qweight, scales, zeros, g_idx, bias, group_size)
    k, n = x.shape[-1], qweight.shape[1]
    a = x.reshape(-1, k).contiguous()  # [M, K]
    m = a.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_linear_kernel[grid](
        a, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), g_idx if g_idx is not None else qweight,
        bias if bias is not None else out, out, m, n, k, a.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), group_size or k, ACT_ORDER=g_idx is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def compile_specs(tuning: Int4LinearTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `int4_linear` makes with `tuning`: each tile height the token counts select, with
    and without bias and act-order, each scale dtype a checkpoint stores (the group size is a
    run-time integer: 32, 64 and 128 are multiples of 16, K per channel is the width's kind)."""
    specs = []
    for dim in dict.fromkeys(int_arg(n) for n in workload.widths):  # N, K: multiples of 16 or not
        for m in workload.token_counts():
            block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
            for scale in SCALE_TYPES:
                for group, act_order, has_bias in product(dict.fromkeys(("i32:16", dim)), (False, True), (False, True)):
                    args = (("A", pointer(workload.dtype)), ("QW", pointer("i32")), ("S", pointer(scale)),
                            ("Z", pointer("i8")), ("GIDX", pointer("i32")), ("B", pointer(workload.dtype)),
                            ("Y", pointer(workload.dtype)), ("M", "i32"), ("N", dim), ("K", dim),
                            ("stride_am", dim), ("stride_qk", dim), ("stride_sg", dim), ("stride_ym", dim),
                            ("GROUP", group))
                    constexprs = (("ACT_ORDER", act_order), ("HAS_BIAS", has_bias),
                                  ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k))
                    dot = None if workload.dtype == "fp32" else "f16"
                    specs.append(CompileSpec(_int4_linear_kernel, args, constexprs, warps, stages, dot=dot))
    return unique(specs)
