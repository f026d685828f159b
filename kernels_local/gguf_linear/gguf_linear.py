"""GGUF linear: y = x @ W.T + b with W kept in llama.cpp's blocks and dequantized in registers, with its
torch reference.

The weight is the GGUF tensor's bytes as the file stores them, one row of blocks per output:
uint8 [N, K / QK * TYPE_SIZE]. Each weight element is decoded where it is used: its block's bytes
are gathered (a block's scale bytes serve all of its elements, so the cache serves the repeats),
its code and scale formed in int32 and fp32 in the order gguf-py's `dequantize` forms them, and
the value rounded to the activations' dtype. Three type families share one decoder
(`_dequant`): the 32-element simple blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), the 256-element
K-blocks with their packed sub-block scales (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4's non-linear
grid (IQ4_NL, IQ4_XS; the 16 grid values are a tensor the kernel gathers from). Two kernels run it:
a GEMV for decode (a few tokens: one program per output tile and token, products summed in fp32,
no tensor core) and a tiled GEMM for prefill (`tl.dot` with fp32 accumulation). The trade-off:
per-element gathers instead of vectorized loads of whole blocks keep one decoder for every type and
tile shape, at the cost of integer work per element that a hand-written kernel per type avoids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

from .reference import BLOCKS, IQ4_GRID, check_layout, gguf_linear_reference

TYPES = tuple(BLOCKS)
GEMV_MAX_M = 4  # up to this many tokens the GEMV runs (decode); more, the GEMM (prefill)

_INTERPRETER_BF16_FIX = tl.constexpr(type(tl.sum).__name__ == "InterpretedFunction")


@triton.jit
def _u8(W, off, mask):
    return tl.load(W + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(W, off, mask):
    bits = _u8(W, off, mask) | (_u8(W, off + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nib(W, off, shift, mask):
    return (_u8(W, off, mask) >> shift) & 0xF


@triton.jit
def _scale_min_k4(W, base, j, mask):
    """Q4_K / Q5_K: the 6-bit scale and min of element j's 32-element sub-block."""
    sub = j // 32
    i = sub % 4
    b0 = _u8(W, base + 4 + i, mask)
    b1 = _u8(W, base + 8 + i, mask)
    b2 = _u8(W, base + 12 + i, mask)
    high = sub >= 4
    sc = tl.where(high, (b2 & 0xF) | ((b0 >> 6) << 4), b0 & 63)
    mn = tl.where(high, (b2 >> 4) | ((b1 >> 6) << 4), b1 & 63)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant(W, GRID, row_off, k, mask, TYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """fp32 values of the weight elements at byte row offsets `row_off` and inputs `k` (broadcast)."""
    base = row_off + (k // QK) * TYPE_SIZE
    j = k % QK
    if TYPE == "Q8_0":
        q = tl.load(W + base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16(W, base, mask)
    elif TYPE == "Q4_0":
        w = _f16(W, base, mask) * (_nib(W, base + 2 + j % 16, 4 * (j // 16), mask) - 8).to(tl.float32)
    elif TYPE == "Q4_1":
        q = _nib(W, base + 4 + j % 16, 4 * (j // 16), mask).to(tl.float32)
        w = _f16(W, base, mask) * q + _f16(W, base + 2, mask)
    elif TYPE == "Q5_0":
        hi = (_u8(W, base + 2 + j // 8, mask) >> (j % 8)) & 1
        q = _nib(W, base + 6 + j % 16, 4 * (j // 16), mask) | (hi << 4)
        w = _f16(W, base, mask) * (q - 16).to(tl.float32)
    elif TYPE == "Q5_1":
        hi = (_u8(W, base + 4 + j // 8, mask) >> (j % 8)) & 1
        q = _nib(W, base + 8 + j % 16, 4 * (j // 16), mask) | (hi << 4)
        w = _f16(W, base, mask) * q.to(tl.float32) + _f16(W, base + 2, mask)
    elif TYPE == "IQ4_NL":
        q = _nib(W, base + 2 + j % 16, 4 * (j // 16), mask)
        w = _f16(W, base, mask) * tl.load(GRID + q, mask=mask, other=0.0)
    elif TYPE == "Q2_K":
        s = _u8(W, base + j // 16, mask)
        r = j % 128
        q = (_u8(W, base + 16 + (j // 128) * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
        dl = _f16(W, base + 80, mask) * (s & 0xF).to(tl.float32)
        ml = _f16(W, base + 82, mask) * (s >> 4).to(tl.float32)
        w = dl * q.to(tl.float32) - ml
    elif TYPE == "Q3_K":
        sub = j // 16
        low = (_u8(W, base + 96 + sub % 8, mask) >> (4 * (sub // 8))) & 0xF
        high = (_u8(W, base + 104 + sub % 4, mask) >> (2 * (sub // 4))) & 3
        sc = (low | (high << 4)) - 32
        r = j % 128
        ql = (_u8(W, base + 32 + (j // 128) * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
        hm = (_u8(W, base + j % 32, mask) >> (j // 32)) & 1
        q = ql - ((hm ^ 1) << 2)
        w = (_f16(W, base + 108, mask) * sc.to(tl.float32)) * q.to(tl.float32)
    elif TYPE == "Q4_K" or TYPE == "Q5_K":
        sc, mn = _scale_min_k4(W, base, j, mask)
        if TYPE == "Q4_K":
            q = _nib(W, base + 16 + (j // 64) * 32 + j % 32, 4 * ((j // 32) % 2), mask)
        else:
            ql = _nib(W, base + 48 + (j // 64) * 32 + j % 32, 4 * ((j // 32) % 2), mask)
            q = ql | (((_u8(W, base + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
        dl = _f16(W, base, mask) * sc
        dm = _f16(W, base + 2, mask) * mn
        w = dl * q.to(tl.float32) - dm
    elif TYPE == "Q6_K":
        r = j % 128
        ql = _nib(W, base + (j // 128) * 64 + r % 64, 4 * (r // 64), mask)
        qh = (_u8(W, base + 128 + (j // 128) * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
        q = (ql | (qh << 4)) - 32
        sc = tl.load(W + base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16(W, base + 208, mask) * sc) * q.to(tl.float32)
    else:  # IQ4_XS
        sub = j // 32
        sl = (_u8(W, base + 4 + sub // 2, mask) >> (4 * (sub % 2))) & 0xF
        sh = ((_u8(W, base + 2, mask) | (_u8(W, base + 3, mask) << 8)) >> (2 * sub)) & 3
        sc = (sl | (sh << 4)) - 32
        r = j % 32
        q = _nib(W, base + 8 + sub * 16 + r % 16, 4 * (r // 16), mask)
        w = (_f16(W, base, mask) * sc.to(tl.float32)) * tl.load(GRID + q, mask=mask, other=0.0)
    return w


@triton.jit
def _to_operand(w, dtype: tl.constexpr):
    """fp32 -> the activations' dtype, round to nearest even (the interpreter's bf16 cast is not)."""
    if dtype == tl.bfloat16:
        bits = w.to(tl.uint32, bitcast=True)
        w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return w.to(dtype)


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    if _INTERPRETER_BF16_FIX:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gguf_gemv_kernel(A, W, GRID, B, Y, N, K, stride_am, stride_ym, TYPE: tl.constexpr, QK: tl.constexpr,
                      TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    # 1. this program's outputs (a tile of rows of W) for one token
    m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_off = offs_n.to(tl.int64)[:, None] * ((K // QK) * TYPE_SIZE)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # 2. the token's inputs and the tile's weights, decoded in registers: [BLOCK_N, BLOCK_K]
        k = k0 + offs_k
        x = tl.load(A + m * stride_am + k, mask=k < K, other=0.0).to(tl.float32)
        w_mask = (offs_n[:, None] < N) & (k[None, :] < K)
        w = _dequant(W, GRID, row_off, k[None, :], w_mask, TYPE, QK, TYPE_SIZE)
        w = _to_operand(w, A.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    # 3. the bias, then the store in the activation dtype
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=offs_n < N)


@triton.jit(do_not_specialize=("M",))  # a step's token count: one compiled variant for every value
def _gguf_gemm_kernel(A, W, GRID, B, Y, M, N, K, stride_am, stride_ym, TYPE: tl.constexpr, QK: tl.constexpr,
                      TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    # 1. this program's output tile [BLOCK_M, BLOCK_N]
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_off = offs_n.to(tl.int64)[None, :] * ((K // QK) * TYPE_SIZE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :], mask=(offs_m[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        # 2. the weight tile [BLOCK_K, BLOCK_N] decoded in registers, rounded to the dot's operand dtype
        w_mask = (k[:, None] < K) & (offs_n[None, :] < N)
        w = _dequant(W, GRID, row_off, k[:, None], w_mask, TYPE, QK, TYPE_SIZE)
        acc = _dot(a, _to_operand(w, A.dtype.element_ty), acc)
    # 3. epilogue: the bias, then the store in the activation dtype
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class GGUFLinearTuning:
    """Tile shapes per architecture family: the GEMM's (BLOCK_M follows the token count) and the GEMV's."""

    name: str
    block_n: int
    block_k: int
    max_block_m: int
    num_warps: int
    num_stages: int
    gemv_block_n: int
    gemv_block_k: int
    gemv_warps: int
    min_block_m: int = 16  # tl.dot needs >= 16 rows

    def launch_shape(self, m: int) -> tuple[str, int, int, int, int, int]:
        """("gemv" | "gemm", BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for `m` tokens."""
        if m <= GEMV_MAX_M:
            return "gemv", 1, self.gemv_block_n, self.gemv_block_k, self.gemv_warps, self.num_stages
        block_m = max(self.min_block_m, min(self.max_block_m, triton.next_power_of_2(m)))
        return "gemm", block_m, self.block_n, self.block_k, self.num_warps, self.num_stages


# Volta and Turing (sm_70..sm_79): GEMM tiles of at most 32 rows (64-row tiles spill there), 32 inputs
# (one simple block, one K sub-block per row), two stages in 64 KB of shared memory; the GEMV reads a
# K-block's width per row.
SM70 = GGUFLinearTuning("sm70", block_n=64, block_k=32, max_block_m=32, num_warps=4, num_stages=2,
                        gemv_block_n=8, gemv_block_k=256, gemv_warps=4)
# Ampere and Ada (sm_80..sm_89): 64-row GEMM tiles.
SM80 = GGUFLinearTuning("sm80", block_n=64, block_k=32, max_block_m=64, num_warps=4, num_stages=2,
                        gemv_block_n=8, gemv_block_k=256, gemv_warps=4)
# Hopper and data-center Blackwell: wider N tiles over 8 warps, three stages.
SM90 = GGUFLinearTuning("sm90", block_n=128, block_k=32, max_block_m=64, num_warps=8, num_stages=3,
                        gemv_block_n=16, gemv_block_k=256, gemv_warps=4)
# CDNA: 64-lane wavefronts, two stages.
ROCM = GGUFLinearTuning("rocm", block_n=64, block_k=32, max_block_m=64, num_warps=4, num_stages=2,
                        gemv_block_n=8, gemv_block_k=256, gemv_warps=4)
TUNINGS = {t.name: t for t in (SM70, SM80, SM90, ROCM)}

_INTERPRETED = type(_gguf_gemm_kernel).__name__ == "InterpretedFunction"
_GRIDS: dict[torch.device, torch.Tensor] = {}


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernels (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def _grid_values(device: torch.device) -> torch.Tensor:
    if device not in _GRIDS:
        _GRIDS[device] = torch.tensor(IQ4_GRID, dtype=torch.float32, device=device)
    return _GRIDS[device]


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, type_name: str, bias: torch.Tensor | None = None, *,
                tuning: GGUFLinearTuning = SM80) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ dequant(qweight).T + bias -> [..., N] in x's dtype.

    `qweight`: the GGUF tensor's bytes, uint8 [N, K / QK * TYPE_SIZE] (one row of blocks per output,
    as the file stores it); `type_name`: its GGUF type, one of `TYPES`. Up to `GEMV_MAX_M` tokens
    the GEMV runs, more the GEMM; on CPU tensors outside the interpreter, the torch reference."""
    check_layout(qweight, type_name, x.shape[-1])
    if not runs_triton(x) or x.numel() == 0:
        return gguf_linear_reference(x, qweight, type_name, bias)
    k, n = x.shape[-1], qweight.shape[0]
    a = x.reshape(-1, k).contiguous()  # [M, K]
    m = a.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kind, block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
    qk, size = BLOCKS[type_name]
    w, grid_values, b = qweight.contiguous(), _grid_values(x.device), bias if bias is not None else out
    if kind == "gemv":
        _gguf_gemv_kernel[(triton.cdiv(n, block_n), m)](
            a, w, grid_values, b, out, n, k, a.stride(0), out.stride(0), TYPE=type_name, QK=qk, TYPE_SIZE=size,
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        _gguf_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            a, w, grid_values, b, out, m, n, k, a.stride(0), out.stride(0), TYPE=type_name, QK=qk, TYPE_SIZE=size,
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def compile_specs(tuning: GGUFLinearTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `gguf_linear` makes with `tuning`: per type, the GEMV and each GEMM tile height the
    token counts select, with and without bias."""
    specs = []
    act = pointer(workload.dtype)
    dot = None if workload.dtype == "fp32" else "f16"
    for dim in dict.fromkeys(int_arg(n) for n in workload.widths):  # N, K: multiples of 16 or not
        for m in workload.token_counts():
            kind, block_m, block_n, block_k, warps, stages = tuning.launch_shape(m)
            for type_name, has_bias in ((t, b) for t in TYPES for b in (False, True)):
                qk, size = BLOCKS[type_name]
                head = (("A", act), ("W", pointer("u8")), ("GRID", pointer("fp32")), ("B", act), ("Y", act))
                types = (("TYPE", type_name), ("QK", qk), ("TYPE_SIZE", size), ("HAS_BIAS", has_bias))
                if kind == "gemv":
                    args = (*head, ("N", dim), ("K", dim), ("stride_am", dim), ("stride_ym", dim))
                    specs.append(CompileSpec(_gguf_gemv_kernel, args,
                                             (*types, ("BLOCK_N", block_n), ("BLOCK_K", block_k)), warps, stages))
                else:
                    args = (*head, ("M", "i32"), ("N", dim), ("K", dim), ("stride_am", dim), ("stride_ym", dim))
                    constexprs = (*types, ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k))
                    specs.append(CompileSpec(_gguf_gemm_kernel, args, constexprs, warps, stages, dot=dot))
    return unique(specs)
