"""RMSNorm as one Triton kernel, its torch reference, and per-architecture launch tuning.

A program normalizes a tile of `ROWS` whole rows (`BLOCK_N` >= the row width), so a row is read
once, reduced in fp32 and written once. The math follows the model's own RMSNorm (transformers'
LlamaRMSNorm): normalize in fp32, round to the input dtype, then multiply by the weight. The
trade-off: rows wider than `MAX_BLOCK_N` do not fit one tile and take the torch reference instead
of a two-pass kernel (no served model is that wide). The tunings (`RMSNormTuning`) change only
rows per program and threads per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

# Widest row one tile holds in registers (fp32 accumulation: 64 KiB per row at 16 warps).
MAX_BLOCK_N = 16384


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    Y,
    n_rows,
    n_cols,
    stride_x,
    stride_y,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # 1. this program's rows and the padded column range
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    # 2. load the tile in fp32; padding reads 0 and adds nothing to the sum of squares
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # 3. mean of squares over the true width, then the reciprocal root per row
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [ROWS]
    # 4. normalize and round to the input dtype first, as the reference does
    h = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    # 5. scale by the weight and store in the output dtype
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = h * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch math the kernel reproduces (LlamaRMSNorm)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@dataclass(frozen=True)
class RMSNormTuning:
    """Launch shape for one architecture family: rows per program and threads per tile.

    - pre-Hopper (sm_70..sm_89): one row per program, ~8 elements per thread. Ampere/Ada have
      fewer SMs and less bandwidth; one row per program already keeps them busy.
    - Hopper and later (sm_90+): several narrow rows per program and ~16 elements per thread,
      so each program moves more bytes per launch on HBM3 (narrow rows waste programs there).
    - ROCm (CDNA, 64-lane wavefronts): a "warp" is 64 lanes, so half the warps per tile."""

    name: str
    tile_elements: int  # target ROWS * BLOCK_N: how many elements one program moves
    max_rows: int  # cap on rows per program
    elements_per_lane: int  # elements each lane handles (vector width x unroll)
    lanes_per_warp: int  # 32 on NVIDIA, 64 on CDNA wavefronts
    max_warps: int

    def launch_shape(self, block_n: int) -> tuple[int, int]:
        """(ROWS, num_warps) for a row padded to `block_n` columns."""
        rows = max(1, min(self.max_rows, self.tile_elements // block_n))
        lanes = rows * block_n // self.elements_per_lane
        warps = max(1, min(self.max_warps, lanes // self.lanes_per_warp))
        return rows, triton.next_power_of_2(warps)


PRE_HOPPER = RMSNormTuning(
    "sm70", tile_elements=1024, max_rows=1, elements_per_lane=8, lanes_per_warp=32, max_warps=8
)
HOPPER = RMSNormTuning(
    "sm90", tile_elements=4096, max_rows=8, elements_per_lane=16, lanes_per_warp=32, max_warps=16
)
ROCM = RMSNormTuning(
    "rocm", tile_elements=2048, max_rows=4, elements_per_lane=16, lanes_per_warp=64, max_warps=16
)
TUNINGS = {t.name: t for t in (PRE_HOPPER, HOPPER, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def _block_n(n: int) -> int | None:
    """The tile width for rows of `n` columns; None when the row is too wide for one tile."""
    block_n = triton.next_power_of_2(n)
    return block_n if block_n <= MAX_BLOCK_N else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, tuning: RMSNormTuning = PRE_HOPPER
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` [..., N] with `weight` [N]; the torch reference on CPU."""
    n = x.shape[-1]
    block_n = _block_n(n)
    if not runs_triton(x) or block_n is None or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    x2 = x.reshape(-1, n)  # [M, N]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows, warps = tuning.launch_shape(block_n)
    grid = (triton.cdiv(x2.shape[0], rows),)
    _rms_norm_kernel[grid](
        x2, weight.contiguous(), out, x2.shape[0], n, x2.stride(0), out.stride(0), eps,
        ROWS=rows, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def compile_specs(tuning: RMSNormTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `rms_norm` makes with `tuning` on rows of the workload's widths."""
    specs = []
    for n in workload.widths:
        block_n = _block_n(n)
        if block_n is None:
            continue  # the torch reference takes rows this wide
        rows, warps = tuning.launch_shape(block_n)
        t = pointer(workload.dtype)
        args = (("X", t), ("W", t), ("Y", t), ("n_rows", "i32"), ("n_cols", int_arg(n)),
                ("stride_x", int_arg(n)), ("stride_y", int_arg(n)), ("eps", "fp32"))  # fmt: skip
        specs.append(CompileSpec(_rms_norm_kernel, args, (("ROWS", rows), ("BLOCK_N", block_n)), warps))
    return unique(specs)
