"""SiluAndMul (`silu(x[..., :I]) * x[..., I:]`) as one Triton kernel, its torch reference, and
per-architecture launch tuning.

A program handles `BLOCK` output columns of one row: it reads the gate and the up half of the
same row and writes one half-width row. Rounding follows the reference exactly (silu rounded to
the input dtype, then the product rounded), so kernel and reference agree bit for bit; the
trade-off is one extra fp32 round-trip per element, free in a memory-bound kernel. The tunings
(`SiluAndMulTuning`) change only columns and warps per program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique


@triton.jit
def _silu_and_mul_kernel(
    X,
    Y,
    n_cols,
    stride_x,
    stride_y,
    BLOCK: tl.constexpr,
):
    # 1. this program's row and its block of output columns
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    # 2. the gate half and the up half of the same input row
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # 3. silu in fp32, rounded to the input dtype as F.silu does
    act = (gate * tl.sigmoid(gate)).to(X.dtype.element_ty).to(tl.float32)
    # 4. the product, rounded once into the output
    tl.store(Y + row * stride_y + cols, (act * up).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """The torch math the kernel reproduces: [..., 2I] -> [..., I]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@dataclass(frozen=True)
class SiluAndMulTuning:
    """Launch shape for one architecture family: columns and warps per program.

    - pre-Hopper (sm_70..sm_89): 1024 columns and 4 warps per program (8 elements per thread).
    - Hopper and later (sm_90+): 4096 columns and 8 warps per program (16 elements per
      thread): fewer, fatter programs keep more bytes in flight on HBM3.
    - ROCm (64-lane wavefronts): 2048 columns over 4 wavefronts."""

    name: str
    block: int  # output columns per program (upper bound; narrower rows use less)
    elements_per_lane: int
    lanes_per_warp: int
    max_warps: int

    def launch_shape(self, n_cols: int) -> tuple[int, int]:
        """(BLOCK, num_warps) for rows of `n_cols` output columns."""
        block = min(self.block, triton.next_power_of_2(n_cols))
        warps = max(1, min(self.max_warps, block // (self.elements_per_lane * self.lanes_per_warp)))
        return block, triton.next_power_of_2(warps)


PRE_HOPPER = SiluAndMulTuning("sm70", block=1024, elements_per_lane=8, lanes_per_warp=32, max_warps=4)
HOPPER = SiluAndMulTuning("sm90", block=4096, elements_per_lane=16, lanes_per_warp=32, max_warps=8)
ROCM = SiluAndMulTuning("rocm", block=2048, elements_per_lane=8, lanes_per_warp=64, max_warps=4)
TUNINGS = {t.name: t for t in (PRE_HOPPER, HOPPER, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_silu_and_mul_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def silu_and_mul(x: torch.Tensor, tuning: SiluAndMulTuning = PRE_HOPPER) -> torch.Tensor:
    """`x` [..., 2I] -> [..., I]; the torch reference on CPU."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"SiluAndMul needs an even last dimension, got `{x.shape[-1]}`")
    if not runs_triton(x) or x.numel() == 0:
        return silu_and_mul_reference(x)
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # [M, 2I]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)  # [M, I]
    block, warps = tuning.launch_shape(d)
    grid = (x2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out, d, x2.stride(0), out.stride(0), BLOCK=block, num_warps=warps)
    return out.reshape(*x.shape[:-1], d)


def compile_specs(tuning: SiluAndMulTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `silu_and_mul` makes with `tuning` on outputs of the workload's widths."""
    specs = []
    for d in workload.widths:
        block, warps = tuning.launch_shape(d)
        t = pointer(workload.dtype)
        args = (("X", t), ("Y", t), ("n_cols", int_arg(d)), ("stride_x", int_arg(2 * d)), ("stride_y", int_arg(d)))
        specs.append(CompileSpec(_silu_and_mul_kernel, args, (("BLOCK", block),), warps))
    return unique(specs)
