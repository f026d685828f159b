"""e4m3 arithmetic for the fp8 linear layers: per-token activation quantization (a Triton
kernel and its torch reference) and byte decoding.

Values are rounded onto the e4m3 grid in fp32 (round-to-nearest-even, saturating) before
any downcast, so a cast of the result to an fp8 dtype is exact and the native and emulated
paths see the same numbers. This repository is self-contained (a `kernels` repository
imports nothing from the server); the host's own quantizer uses the same rule, and a test
checks the two agree bit for bit. On a GPU the per-token quantization is one fused kernel
(one program per token: amax, scale, rounding, store) instead of a dozen elementwise
launches, which would dominate a decode step's small matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique


@dataclass(frozen=True)
class E4M3:
    """One e4m3 flavour: `e4m3fn` (OCP, NVIDIA) or `e4m3fnuz` (AMD CDNA3)."""

    name: str
    bias: int
    max_value: float
    torch_dtype_name: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype_name)


FORMATS = {
    "e4m3fn": E4M3("e4m3fn", bias=7, max_value=448.0, torch_dtype_name="float8_e4m3fn"),
    "e4m3fnuz": E4M3("e4m3fnuz", bias=8, max_value=240.0, torch_dtype_name="float8_e4m3fnuz"),
}


def get_format(fmt: str) -> E4M3:
    if fmt not in FORMATS:
        raise ValueError(f"Unknown e4m3 format `{fmt}`. Supported: {', '.join(sorted(FORMATS))}")
    return FORMATS[fmt]


def round_to_grid(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values rounded onto the e4m3 grid (RNE, saturating at the format's max)."""
    f = get_format(fmt)
    x = x.to(torch.float32)
    a = x.abs()
    # 1. exponent of each value, floored at the smallest normal (subnormals share its spacing)
    _, e = torch.frexp(a)
    exp = (e - 1).clamp(min=1 - f.bias)
    # 2. spacing of 3 mantissa bits at that exponent; dividing by a power of two is exact
    step = torch.exp2((exp - 3).to(torch.float32))
    # 3. round half to even on the grid, saturate, restore the sign
    r = torch.copysign((torch.round(a / step) * step).clamp(max=f.max_value), x)
    if fmt == "e4m3fnuz":
        r = torch.where(r == 0, torch.zeros_like(r), r)  # fnuz has no negative zero
    return r


def quantize_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of x [M, K]: on-grid fp32 values [M, K] and fp32 scales [M, 1]."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    scale = (amax / get_format(fmt).max_value).clamp(min=torch.finfo(torch.float32).tiny)
    return round_to_grid(x32 / scale, fmt), scale


@cache
def _decode_table(fmt: str) -> torch.Tensor:
    f = get_format(fmt)
    b = torch.arange(256, dtype=torch.int32)
    sign = torch.where((b >> 7) == 1, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = sign * (8 + man) * torch.exp2((exp - f.bias - 3).to(torch.float32))
    sub = sign * man * 2.0 ** (-f.bias - 2)
    return torch.where(exp == 0, sub, normal)


def decode(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 e4m3 bytes (exact; NaN encodings are not expected in weights)."""
    return _decode_table(fmt).to(q.device)[q.to(torch.int64)]


@triton.jit
def _round_to_e4m3(v, MAX_VALUE: tl.constexpr, BIAS: tl.constexpr, FNUZ: tl.constexpr):
    # 1. exponent of |v| from its fp32 bits, floored at the smallest normal
    a = tl.abs(v)
    e = (a.to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 127
    e = tl.maximum(e, 1 - BIAS)
    # 2. scale to units of the grid spacing 2**(e - 3): multiplying by a power of two is exact
    t = a * ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    # 3. round half to even: floor(t + 0.5) is exact for t < 16; ties go back to the even integer
    r = tl.floor(t + 0.5)
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((r - t == 0.5) & odd, r - 1.0, r)
    # 4. back to a value, saturate, and put the sign bit back (fnuz has no negative zero)
    r = tl.minimum(r * ((e - 3 + 127) << 23).to(tl.float32, bitcast=True), MAX_VALUE)
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if FNUZ:
        r = tl.where(r == 0.0, 0.0, r)
    return r


@triton.jit
def _quantize_rows_kernel(
    X,
    Q,
    S,
    n_cols,
    stride_x,
    stride_q,
    MAX_VALUE: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # 1. this program's token (row) and the column block it walks with
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    # 2. amax over the row
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, n_cols, BLOCK):
        x = tl.load(X + row * stride_x + k0 + offs, mask=k0 + offs < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # 3. the row's scale, with IEEE division as the torch reference computes it
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), MAX_VALUE), 1.1754943508222875e-38)
    tl.store(S + row, scale)
    # 4. x / scale rounded onto the grid, stored exactly in Q's dtype (fp8, or fp16 grid values)
    for k0 in range(0, n_cols, BLOCK):
        mask = k0 + offs < n_cols
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        r = _round_to_e4m3(tl.div_rn(x, scale), MAX_VALUE, BIAS, FNUZ)
        tl.store(Q + row * stride_q + k0 + offs, r.to(Q.dtype.element_ty), mask=mask)


def quantize_rows_triton(
    x: torch.Tensor, fmt: str, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` as one kernel: x [M, K] -> grid values [M, K] in `out_dtype` (an fp8
    dtype, or fp16: both hold every e4m3 value exactly) and fp32 scales [M, 1]."""
    f = get_format(fmt)
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block, warps = _quantize_launch(k)
    _quantize_rows_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0),
        MAX_VALUE=f.max_value, BIAS=f.bias, FNUZ=fmt == "e4m3fnuz", BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return q, scale


def _quantize_launch(k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of `k` columns: a row is walked in blocks of at most 4096."""
    block = min(4096, triton.next_power_of_2(k))
    return block, 4 if block >= 1024 else 1


def quantize_specs(workload: Workload, out_type: str) -> tuple[CompileSpec, ...]:
    """Every launch `quantize_rows_triton` makes on rows of the workload's widths, writing
    `out_type` (Triton's name: an fp8 type, or "fp16" grid values)."""
    f = get_format(workload.fp8_fmt)
    specs = []
    for k in workload.widths:
        block, warps = _quantize_launch(k)
        args = (("X", pointer(workload.dtype)), ("Q", pointer(out_type)), ("S", pointer("fp32")),
                ("n_cols", int_arg(k)), ("stride_x", int_arg(k)), ("stride_q", int_arg(k)))  # fmt: skip
        constexprs = (("MAX_VALUE", f.max_value), ("BIAS", f.bias), ("FNUZ", f.name == "e4m3fnuz"), ("BLOCK", block))
        specs.append(CompileSpec(_quantize_rows_kernel, args, constexprs, warps))
    return unique(specs)


# -- pre-quantized checkpoints: activations per token group, or with a static scale ---------------


def quantize_groups(x: torch.Tensor, fmt: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and `group` columns: on-grid fp32 values [M, K] and fp32 scales [M, ceil(K / group)]
    (the last group may be narrower)."""
    m, k = x.shape
    g = triton.cdiv(k, group)
    x32 = torch.nn.functional.pad(x.to(torch.float32), (0, g * group - k)).reshape(m, g, group)  # [M, G, group]
    amax = x32.abs().amax(dim=-1)  # [M, G]
    scale = (amax / get_format(fmt).max_value).clamp(min=torch.finfo(torch.float32).tiny)
    return round_to_grid(x32 / scale[..., None], fmt).reshape(m, g * group)[:, :k], scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """With a checkpoint's static per-tensor `scale` (0-d): on-grid fp32 values [M, K] (saturated)
    and the scale repeated per row [M, 1]."""
    s = scale.to(torch.float32).reshape(1, 1)
    return round_to_grid(x.to(torch.float32) / s, fmt), s.expand(x.shape[0], 1).contiguous()


@triton.jit(do_not_specialize=("stride_s",))
def _quantize_groups_kernel(
    X,
    Q,
    S,
    n_cols,
    stride_x,
    stride_q,
    stride_s,
    MAX_VALUE: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    GROUP: tl.constexpr,
):
    # 1. this program's token (row) and column group
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < n_cols
    # 2. the group's amax and scale (IEEE division, as the torch reference)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), MAX_VALUE), 1.1754943508222875e-38)
    tl.store(S + row * stride_s + group, scale)
    # 3. x / scale rounded onto the grid, stored exactly in Q's dtype
    r = _round_to_e4m3(tl.div_rn(x, scale), MAX_VALUE, BIAS, FNUZ)
    tl.store(Q + row * stride_q + offs, r.to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_static_kernel(
    X,
    Q,
    S,
    SCALE,
    n_cols,
    stride_x,
    stride_q,
    MAX_VALUE: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # 1. this program's token (row); the checkpoint's scale, written per row for the GEMM's epilogue
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    scale = tl.load(SCALE)
    tl.store(S + row, scale)
    # 2. x / scale saturated and rounded onto the grid, block by block
    for k0 in range(0, n_cols, BLOCK):
        mask = k0 + offs < n_cols
        x = tl.load(X + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        r = _round_to_e4m3(tl.div_rn(x, scale), MAX_VALUE, BIAS, FNUZ)
        tl.store(Q + row * stride_q + k0 + offs, r.to(Q.dtype.element_ty), mask=mask)


def quantize_groups_triton(x: torch.Tensor, fmt: str, group: int, out_dtype: torch.dtype):
    """`quantize_groups` as one kernel: (values [M, K] in `out_dtype`, scales [M, ceil(K / group)] fp32)."""
    f = get_format(fmt)
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    g = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, g), dtype=torch.float32, device=x.device)
    _quantize_groups_kernel[(m, g)](
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
        MAX_VALUE=f.max_value, BIAS=f.bias, FNUZ=fmt == "e4m3fnuz", GROUP=group, num_warps=_GROUP_WARPS,
    )  # fmt: skip
    return q, scale


def quantize_static_triton(x: torch.Tensor, scale: torch.Tensor, fmt: str, out_dtype: torch.dtype):
    """`quantize_static` as one kernel: (values [M, K] in `out_dtype`, the scale per row [M, 1] fp32)."""
    f = get_format(fmt)
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    rows = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block, warps = _quantize_launch(k)
    _quantize_static_kernel[(m,)](
        x, q, rows, scale.to(torch.float32).reshape(1).contiguous(), k, x.stride(0), q.stride(0),
        MAX_VALUE=f.max_value, BIAS=f.bias, FNUZ=fmt == "e4m3fnuz", BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return q, rows


_GROUP_WARPS = 1  # a 128-column group is one warp's 4 elements per thread


def checkpoint_quantize_specs(workload: Workload, out_type: str, group: int | None) -> tuple[CompileSpec, ...]:
    """The activation quantizer a checkpoint layer launches: per token group of `group` columns
    (block weights), or per token and with a static scale (the others), on the workload's widths."""
    f = get_format(workload.fp8_fmt)
    consts = (("MAX_VALUE", f.max_value), ("BIAS", f.bias), ("FNUZ", f.name == "e4m3fnuz"))
    specs = []
    for k in workload.widths:
        if group is not None:
            args = (("X", pointer(workload.dtype)), ("Q", pointer(out_type)), ("S", pointer("fp32")),
                    ("n_cols", int_arg(k)), ("stride_x", int_arg(k)), ("stride_q", int_arg(k)),
                    ("stride_s", "i32"))  # fmt: skip
            specs.append(CompileSpec(_quantize_groups_kernel, args, (*consts, ("GROUP", group)), _GROUP_WARPS))
            continue
        block, warps = _quantize_launch(k)
        args = (("X", pointer(workload.dtype)), ("Q", pointer(out_type)), ("S", pointer("fp32")),
                ("SCALE", pointer("fp32")), ("n_cols", int_arg(k)), ("stride_x", int_arg(k)),
                ("stride_q", int_arg(k)))  # fmt: skip
        specs.append(CompileSpec(_quantize_static_kernel, args, (*consts, ("BLOCK", block)), warps))
    return unique(specs)
