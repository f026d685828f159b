"""The LoRA delta of one projection for a batch whose rows use different adapters (or none):
`out[row, part] += scale[l] * (x[row] @ A_l^T) @ B_l^T` for each row's adapter `l`, in two launches,
and its torch reference.

Punica's layout: the adapters of a step are stacked per projection (`LoraStack`: A [L, P*R, K] with
each part's ranks in its own R-wide band, B [L, N, R] with each output row's pair, zero padding for
lower ranks and parts an adapter does not target), and the rows that carry an adapter are gathered
into segments of one adapter each (`LoraSegments`: row indices, segment bounds, each segment's
adapter); base-only rows are in no segment and are never touched. The shrink launch writes
T [rows, P*R] = x @ A^T per segment tile, the expand launch adds (T_part @ B^T) * scale into the
columns of each part of `out`, in place. A segment tile of 16 rows or more runs `tl.dot` (SGMV: a
prefill chunk, or many decode rows of one adapter); when every segment is a few rows (decode rows
spread over adapters) each program takes one row and reduces in registers (BGMV), since a 16-row
tensor-core tile would be mostly padding. Each slot's own rank in the projection (`ranks`, rounded
up to 16) bounds the bands it computes: the shrink skips bands past it and the expand stops there,
so a slot sized for rank 64 holding a rank-8 adapter pays for 16. The trade-off: ranks pad to a
multiple of 16, and every segment's tile runs the stack's band width in its grid (skipped bands
are launched programs that return at once); in exchange one launch pair serves every adapter of
the step, whatever it mixes. T keeps
the adapters' dtype between the two launches, as the reference rounds `x @ A^T`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

RANK_ALIGN = 16  # ranks pad to a multiple of this (tl.dot's smallest K), so T's row stride is too
BGMV_MAX_ROWS = 4  # segments no longer than this run one row per program, without tensor cores

# Triton's interpreter (TRITON_INTERPRET=1) multiplies bf16 dot operands as their raw uint16 bits;
# under it, bf16 dots upcast to fp32 first (exact, as a tensor core's products are).
_INTERPRETER_BF16_FIX = tl.constexpr(type(tl.sum).__name__ == "InterpretedFunction")


@triton.jit
def _mm(a, b, acc, USE_DOT: tl.constexpr):
    # acc [BM, BN] += a [BM, BK] @ b [BK, BN]: tensor cores for tiles of 16 rows or more (fp32 in
    # IEEE precision), a broadcast product reduced in registers for one-row tiles
    if USE_DOT:
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        if _INTERPRETER_BF16_FIX:
            if a.dtype == tl.bfloat16:
                return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)
    return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _segment_rows(ROWS, SEG_START, BLOCK_M: tl.constexpr):
    # the rows of this program's tile: segment program_id(0), tile program_id(1) of it, gathered
    # through ROWS; rows past the segment's end are masked off (their tile does nothing)
    seg = tl.program_id(0)
    end = tl.load(SEG_START + seg + 1)
    offs = tl.load(SEG_START + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = offs < end
    rows = tl.load(ROWS + offs, mask=ok, other=0).to(tl.int64)
    return seg, rows, ok


@triton.jit
def _lora_shrink_kernel(
    X,
    A,
    T,
    ROWS,
    SEG_START,
    SEG_LORA,
    RANKS,
    K,
    R,
    RANK,
    stride_xm,
    stride_al,
    stride_ar,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 1. this tile's rows, their adapter and the band of ranks [BLOCK_R] it computes: none past the
    # adapter's own (padded) rank in its part, whose T the expand never reads
    seg, rows, row_ok = _segment_rows(ROWS, SEG_START, BLOCK_M)
    lora = tl.load(SEG_LORA + seg).to(tl.int64)
    if (tl.program_id(2) * BLOCK_R) % RANK >= tl.load(RANKS + lora):
        return
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # 2. T = x @ A_l^T over K, x cast to the adapters' dtype as the reference does
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        a = tl.load(A + lora * stride_al + offs_r[None, :] * stride_ar + k[:, None],
                    mask=(k[:, None] < K) & r_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
        acc = _mm(x.to(A.dtype.element_ty), a, acc, BLOCK_M >= 16)
    # 3. stored in the adapters' dtype, at each row's own index
    tl.store(T + rows[:, None] * stride_tm + offs_r[None, :], acc.to(T.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=("N_BLOCKS",))
def _lora_expand_kernel(
    T,
    B,
    OUT,
    ROWS,
    SEG_START,
    SEG_LORA,
    RANKS,
    SCALES,
    PART_OFF,
    PART_SIZE,
    R,
    N_BLOCKS,
    stride_tm,
    stride_bl,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # 1. this tile's rows and adapter; program_id(2) is (part, column block of that part)
    seg, rows, row_ok = _segment_rows(ROWS, SEG_START, BLOCK_M)
    lora = tl.load(SEG_LORA + seg).to(tl.int64)
    part = tl.program_id(2) // N_BLOCKS
    off = tl.load(PART_OFF + part)
    cols = (tl.program_id(2) % N_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < tl.load(PART_SIZE + part)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 2. T's band of this part [BLOCK_M, R] @ B_l's rows of this part's columns [R, BLOCK_N]
    for r0 in range(0, tl.load(RANKS + lora), BLOCK_R):
        r = r0 + offs_r
        t = tl.load(T + rows[:, None] * stride_tm + (part * R + r)[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(B + lora * stride_bl + (off + cols)[None, :] * stride_bn + r[:, None], mask=col_ok[None, :],
                    other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = _mm(t, b, acc, BLOCK_M >= 16)
    # 3. rounded to the adapters' dtype, scaled (rounded again), added to out in fp32, stored
    scale = tl.load(SCALES + lora)
    delta = (acc.to(B.dtype.element_ty).to(tl.float32) * scale).to(B.dtype.element_ty).to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = OUT + rows[:, None] * stride_om + (off + cols)[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(ptrs, y.to(OUT.dtype.element_ty), mask=mask)


@dataclass(frozen=True, eq=False)
class LoraStack:
    """One projection's pairs of the step's adapters, stacked (slot `l` = adapter `l` of the step)."""

    a: torch.Tensor  # [L, P*R, K]: part p's ranks in rows p*R .. p*R + r_l, zeros beyond
    b: torch.Tensor  # [L, N, R]: output row n's pair (of the part holding n), zeros beyond r_l
    scales: torch.Tensor  # [L] fp32
    part_offsets: torch.Tensor  # [P] int32: first output column of each part
    part_sizes: torch.Tensor  # [P] int32
    rank: int  # R, a multiple of RANK_ALIGN
    max_part: int  # the widest part's size
    ranks: torch.Tensor  # [L] int32: each slot's rank here, rounded up to RANK_ALIGN (0: it targets nothing here)


@dataclass(frozen=True, eq=False)
class LoraSegments:
    """The rows of one forward that carry an adapter, gathered by adapter."""

    rows: torch.Tensor  # [M'] int32: row indices, each segment's rows together
    starts: torch.Tensor  # [S + 1] int32: segment s is rows[starts[s]:starts[s + 1]]
    loras: torch.Tensor  # [S] int32: each segment's slot in the stacks
    max_rows: int  # the longest segment

    @classmethod
    def from_groups(cls, groups: list[torch.Tensor], slots: list[int]) -> LoraSegments:
        """Segments from each adapter's row indices (int64 or int32, one tensor per segment) and slot."""
        device = groups[0].device
        counts = torch.tensor([0] + [len(g) for g in groups], dtype=torch.int64)
        return cls(torch.cat(groups).to(torch.int32), counts.cumsum(0).to(device=device, dtype=torch.int32),
                   torch.tensor(slots, dtype=torch.int32, device=device), int(counts.max()))


def lora_sgmv_reference(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, segments: LoraSegments) -> None:
    """The torch math, in place: for each segment, its rows' `x @ A^T` (in the adapters' dtype), each
    part's band `@ B^T`, times the scale (in that dtype), added to `out`'s part columns."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    r = stack.rank
    bounds = segments.starts.tolist()
    for s, lora in enumerate(segments.loras.tolist()):
        rows = segments.rows[bounds[s]:bounds[s + 1]].long()
        t = x2.index_select(0, rows).to(stack.a.dtype) @ stack.a[lora].T  # [n, P*R]
        for p, (off, size) in enumerate(zip(stack.part_offsets.tolist(), stack.part_sizes.tolist(), strict=True)):
            delta = (t[:, p * r:(p + 1) * r] @ stack.b[lora, off:off + size].T) * float(stack.scales[lora])
            out2.narrow(1, off, size).index_add_(0, rows, delta.to(out2.dtype))


@dataclass(frozen=True)
class LoraTuning:
    """Tiles per architecture family: the K block of the shrink, the column block of the expand, the
    rank block of both, the tallest segment tile; the BGMV form takes one row per program."""

    name: str
    block_k: int
    block_n: int
    max_block_m: int
    num_warps: int
    num_stages: int
    block_r: int = RANK_ALIGN

    def block_ms(self) -> tuple[int, ...]:
        """Every tile height a launch can pick: 1 (BGMV), then powers of two from 16 (SGMV)."""
        out, m = [1], 16
        while m <= self.max_block_m:
            out.append(m)
            m *= 2
        return tuple(out)

    def block_m(self, max_rows: int) -> int:
        """The tile height for segments of at most `max_rows` rows."""
        if max_rows <= BGMV_MAX_ROWS:
            return 1
        return max(16, min(self.max_block_m, triton.next_power_of_2(max_rows)))


# Volta to Ada, and consumer Blackwell: 4 warps, two stages (the loops are short: K / 32 steps)
SM70 = LoraTuning("sm70", block_k=32, block_n=64, max_block_m=32, num_warps=4, num_stages=2)
# Hopper and Blackwell: wider K and column blocks, taller segment tiles over 8 warps (4 spill on sm_100)
SM90 = LoraTuning("sm90", block_k=64, block_n=128, max_block_m=64, num_warps=8, num_stages=3)
# CDNA: 64-lane wavefronts, two stages in 64 KiB of LDS
ROCM = LoraTuning("rocm", block_k=32, block_n=64, max_block_m=32, num_warps=4, num_stages=2)
TUNINGS = {t.name: t for t in (SM70, SM90, ROCM)}

_INTERPRETED = type(_lora_shrink_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernels (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def lora_sgmv(x: torch.Tensor, out: torch.Tensor, stack: LoraStack, segments: LoraSegments, *,
              tuning: LoraTuning = SM70) -> None:  # fmt: skip
    """`out` [..., N] += each segment's LoRA delta of `x` [..., K], in place (see the module docstring);
    rows in no segment are left as they are. The torch reference where Triton does not run."""
    if stack.a.shape[-1] != x.shape[-1] or stack.b.shape[1] > out.shape[-1] or stack.rank % tuning.block_r:
        raise ValueError(f"LoRA stack A {tuple(stack.a.shape)} / B {tuple(stack.b.shape)} (rank {stack.rank}) does "
                         f"not fit x {tuple(x.shape)} and out {tuple(out.shape)}")
    if not runs_triton(x) or segments.rows.numel() == 0:
        return lora_sgmv_reference(x, out, stack, segments)
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [M, K], [M, N]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert out2.stride(-1) == 1, "LoRA output rows must be contiguous"
    k, r, parts = x2.shape[1], stack.rank, stack.part_offsets.numel()
    block_m = tuning.block_m(segments.max_rows)
    n_segments = segments.loras.numel()
    m_blocks = triton.cdiv(segments.max_rows, block_m)
    t = torch.empty((x2.shape[0], parts * r), dtype=stack.a.dtype, device=x.device)  # [M, P*R]
    # 1. shrink: T = x @ A^T, one program per (segment, row tile, rank band)
    _lora_shrink_kernel[(n_segments, m_blocks, triton.cdiv(parts * r, tuning.block_r))](
        x2, stack.a, t, segments.rows, segments.starts, segments.loras, stack.ranks, k, parts * r, r, x2.stride(0),
        stack.a.stride(0), stack.a.stride(1), t.stride(0),
        BLOCK_M=block_m, BLOCK_R=tuning.block_r, BLOCK_K=tuning.block_k,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip
    # 2. expand: out[:, part] += (T_part @ B^T) * scale, one program per (segment, row tile, part x column block)
    n_blocks = triton.cdiv(stack.max_part, tuning.block_n)
    _lora_expand_kernel[(n_segments, m_blocks, parts * n_blocks)](
        t, stack.b, out2, segments.rows, segments.starts, segments.loras, stack.ranks, stack.scales, stack.part_offsets,
        stack.part_sizes, r, n_blocks, t.stride(0), stack.b.stride(0), stack.b.stride(1), out2.stride(0),
        BLOCK_M=block_m, BLOCK_N=tuning.block_n, BLOCK_R=tuning.block_r,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )  # fmt: skip


def compile_specs(tuning: LoraTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `lora_sgmv` makes with `tuning`: both kernels at each tile height (BGMV's one row,
    SGMV's 16 and up) for each width's kind; the adapters are in the model's dtype, T too, and every
    rank-derived stride is a multiple of 16 (ranks pad to RANK_ALIGN)."""
    specs = []
    dtype, ptr, idx = workload.dtype, pointer(workload.dtype), pointer("i32")
    dot = None if dtype == "fp32" else "f16"
    for dim in dict.fromkeys(int_arg(n) for n in workload.widths):
        for block_m in tuning.block_ms():
            launch_dot = dot if block_m >= 16 else None
            shrink = (("X", ptr), ("A", ptr), ("T", ptr), ("ROWS", idx), ("SEG_START", idx), ("SEG_LORA", idx),
                      ("RANKS", idx), ("K", dim), ("R", "i32:16"), ("RANK", "i32:16"), ("stride_xm", dim),
                      ("stride_al", "i32:16"), ("stride_ar", dim), ("stride_tm", "i32:16"))
            specs.append(CompileSpec(_lora_shrink_kernel, shrink, (("BLOCK_M", block_m), ("BLOCK_R", tuning.block_r),
                                                                   ("BLOCK_K", tuning.block_k)),
                                     tuning.num_warps, tuning.num_stages, dot=launch_dot))
            expand = (("T", ptr), ("B", ptr), ("OUT", ptr), ("ROWS", idx), ("SEG_START", idx), ("SEG_LORA", idx),
                      ("RANKS", idx), ("SCALES", pointer("fp32")), ("PART_OFF", idx), ("PART_SIZE", idx),
                      ("R", "i32:16"), ("N_BLOCKS", "i32"), ("stride_tm", "i32:16"), ("stride_bl", "i32:16"),
                      ("stride_bn", "i32:16"), ("stride_om", dim))
            specs.append(CompileSpec(_lora_expand_kernel, expand, (("BLOCK_M", block_m), ("BLOCK_N", tuning.block_n),
                                                                   ("BLOCK_R", tuning.block_r)),
                                     tuning.num_warps, tuning.num_stages, dot=launch_dot))
    return unique(specs)
