"""Decode attention over a paged KV cache as one Triton kernel, its torch path, and launch tuning.

One program per (sequence, query head) walks the sequence's positions `TILE` at a time from the
window's first one, finds each position's block through the block table (any block size; a tile
may span blocks) and keeps a running max and sum in fp32 (online softmax, as flash-decoding does);
the query heads of one KV group read the same K/V. Block size, group, pool size, window, cap and
scale are runtime arguments, so one compiled launch per padded head dim serves every layer and
step. The trade-off: the G query heads of a group load their K/V tiles separately (G x the reads
of a fused group kernel, mostly served from L2), which keeps the kernel free of `tl.dot` and its
per-architecture precision and shape constraints (fp32 inputs would be rounded to tf32 on Ampere
and later). The layout and options: `paged_decode`; the launch shapes: `PagedAttentionTuning`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

# Runtime integers compiled once for every value (no divisibility or ==1 specialization): one
# launch per padded head dim serves every block size, group, pool size, window and step, at the
# cost of a division and a modulo by a runtime block size per position (negligible next to the
# K/V loads). K/V rows are addressed as `(head * num_blocks + block) * block_size + offset`, so no
# stride exceeds int32 however large the pool.
_UNSPECIALIZED = ("stride_n", "num_blocks", "stride_bt", "group", "block_size", "window", "use_sinks")
# The window of a layer that does not slide: larger than any sequence (int32, as launched).
FULL_WINDOW = 2**31 - 1
# Values of a K tile (and of V) one thread holds at most: the warps grow with the tile past it.
MAX_PER_THREAD = 32
# The padded head dim from which a tuning's `wide_head_warps` apply (see `PagedAttentionTuning`).
WIDE_HEAD = 512


@triton.jit
def _tanh(x):
    # `triton.language` has no tanh, and libdevice's is per backend and has moved between versions.
    # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _paged_decode_kernel(
    Q,
    K,
    V,
    Out,
    BLOCK_TABLES,
    SEQ_LENS,
    SINKS,
    stride_n,
    num_blocks,
    stride_bt,
    group,
    block_size,
    window,
    use_sinks,
    head_dim,
    softcap,
    scale,
    TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # 1. this program's sequence, query head and the KV head its group reads
    n = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // group
    seq_len = tl.load(SEQ_LENS + n)
    d = tl.arange(0, HEAD_DIM)
    d_mask = d < head_dim
    q = tl.load(Q + n * stride_n + h * head_dim + d, mask=d_mask, other=0.0).to(tl.float32)
    q = q * scale
    # 2. running max, running sum and the weighted sum of V, in fp32; a head's sink (gpt-oss)
    #    starts them as one more position, of logit `sink` and value 0 (SINKS[0] when unused)
    sink = tl.load(SINKS + h * use_sinks).to(tl.float32)
    m_i = tl.zeros([1], dtype=tl.float32) + tl.where(use_sinks != 0, sink, float("-inf"))
    l_i = tl.zeros([1], dtype=tl.float32) + tl.where(use_sinks != 0, 1.0, 0.0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    # 3. the window's first position: the loop never reads a position (nor a block) before it
    lo = tl.maximum(seq_len - window, 0)
    for start in range(lo, seq_len, TILE):
        # 4. this tile's positions -> their blocks (through the table) -> K/V addresses
        pos = start + tl.arange(0, TILE)
        p_mask = pos < seq_len
        block = tl.load(BLOCK_TABLES + n * stride_bt + pos // block_size, mask=p_mask, other=0)
        row = (kv_head * num_blocks + block.to(tl.int64)) * block_size + pos % block_size  # [TILE]
        base = row * head_dim
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(K + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, HEAD_DIM]
        # 5. scores of this tile (fp32), soft-capped where the layer asks; masked positions get -inf
        s = tl.sum(k * q[None, :], axis=1)  # [TILE]
        if softcap > 0:
            s = softcap * _tanh(s / softcap)
        s = tl.where(p_mask, s, float("-inf"))
        # 6. online softmax: rescale what was accumulated to the new running max
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)  # [TILE]
        v = tl.load(V + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, HEAD_DIM]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    # 7. normalize and store in the query's dtype
    out = acc / l_i
    tl.store(Out + n * stride_n + h * head_dim + d, out.to(Out.dtype.element_ty), mask=d_mask)


def paged_decode_reference(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch path: gather the rows' blocks, one masked attention with the GQA group folded
    into the query axis (SDPA; with a `softcap`, the same in explicit ops, the softmax in fp32
    as transformers' eager attention). `query` [N, Hq, D], `kv` [2, Hkv, NB, B, D] -> [N, Hq, D];
    the options as `paged_decode` takes them."""
    _, hkv, nb, bs, d = kv.shape
    n, hq, _ = query.shape
    g = kv.reshape(2 * hkv, nb, bs * d).index_select(1, block_tables.flatten())  # [2*Hkv, N*MB, B*D]
    g = g.view(2, hkv, n, -1, d)[..., :max_len, :]  # [2, Hkv, N, L, D]
    k, v = g[0].transpose(0, 1), g[1].transpose(0, 1)  # [N, Hkv, L, D]
    cols = torch.arange(max_len, device=query.device)[None, :]  # [1, L]
    mask = cols < seq_lens[:, None]  # [N, L]
    if window:
        mask &= cols >= seq_lens[:, None] - window
    mask = mask[:, None, None, :]  # [N, 1, 1, L]
    q = query.view(n, hkv, hq // hkv, d)  # [N, Hkv, G, D]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if not softcap and sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)  # [N, Hkv, G, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more logit per head, its weight dropped after the softmax
            sink = sinks.to(scores.dtype).view(1, hkv, hq // hkv, 1).expand(n, -1, -1, 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        o = torch.matmul((probs if sinks is None else probs[..., :-1]).to(q.dtype), v)
    return o.reshape(n, hq, d)


@dataclass(frozen=True)
class PagedAttentionTuning:
    """Launch shape for one architecture family: positions per iteration and warps.

    Grid `(num_rows, num_query_heads)`; `TILE = clamp(tile_elements // HEAD_DIM, 16, max_tile)`:
    - pre-Hopper (sm_70..sm_89): tile_elements 4096, max_tile 64, 4 warps;
    - Hopper and later (sm_90+): tile_elements 8192, max_tile 128, 8 warps (more bytes in flight);
    - ROCm (64-lane wavefronts): tile_elements 4096, max_tile 64, 4 wavefronts.
    At head dim 256 (Gemma) that is 16 positions (4 warps) or 32 (8 warps). Warps grow with the
    tile so that no thread holds more than `MAX_PER_THREAD` values of a K tile: at head dim 512
    (Gemma 4's global layers; FlashAttention-style kernels stop at 256) a 16-position tile takes 8
    warps pre-Hopper. On 32-lane GPUs a padded head dim of `WIDE_HEAD` takes `wide_head_warps`
    (16): with 8, Triton spilled on sm_80 and sm_90. Registers and spills per tuning:
    docs/benchmarks.md "Preflight matrix"."""

    name: str
    tile_elements: int  # TILE x HEAD_DIM elements of K (and of V) one iteration holds
    max_tile: int
    num_warps: int  # at least; more where a tile would give a thread over MAX_PER_THREAD values
    lanes: int = 32  # threads per warp (64 per ROCm wavefront)
    wide_head_warps: int = 0  # warps at least at a padded head dim of WIDE_HEAD or more (0: no floor)

    def launch_shape(self, head_dim: int) -> tuple[int, int, int]:
        """(TILE, HEAD_DIM, num_warps) for a head dim."""
        padded = triton.next_power_of_2(head_dim)
        tile = max(16, min(self.max_tile, self.tile_elements // padded))
        warps = max(self.num_warps, tile * padded // (self.lanes * MAX_PER_THREAD))
        return tile, padded, max(warps, self.wide_head_warps) if padded >= WIDE_HEAD else warps


PRE_HOPPER = PagedAttentionTuning("sm70", tile_elements=4096, max_tile=64, num_warps=4, wide_head_warps=16)
HOPPER = PagedAttentionTuning("sm90", tile_elements=8192, max_tile=128, num_warps=8, wide_head_warps=16)
ROCM = PagedAttentionTuning("rocm", tile_elements=4096, max_tile=64, num_warps=4, lanes=64)
TUNINGS = {t.name: t for t in (PRE_HOPPER, HOPPER, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_paged_decode_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


_NO_SINKS: dict[torch.device, torch.Tensor] = {}


def _no_sinks(device: torch.device) -> torch.Tensor:
    """The SINKS argument of a layer without sinks: one fp32 zero the kernel reads and ignores."""
    if device not in _NO_SINKS:
        _NO_SINKS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _NO_SINKS[device]


def _kernel_options(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The kernel's `window` and `softcap` arguments for a layer's options (None or 0: off)."""
    if window is not None and window < 0:
        raise ValueError(f"Sliding window `{window}` is negative. Allowed: None or 0 (full), or a positive length")
    if softcap is not None and softcap < 0:
        raise ValueError(f"Softcap `{softcap}` is negative. Allowed: None or 0 (off), or a positive cap")
    return min(window, FULL_WINDOW) if window else FULL_WINDOW, float(softcap or 0.0)


def paged_decode(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    tuning: PagedAttentionTuning = PRE_HOPPER,
    *,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention `query` [N, Hq, D] over `kv` [2, Hkv, NB, B, D] through `block_tables`
    [N, MB] for rows of `seq_lens` [N] positions -> [N, Hq, D]; the torch path on CPU. Each row
    attends its last `window` positions (None or 0: all), its scores scaled by `scale` (None:
    1/sqrt(D)) and then soft-capped to `softcap` (None or 0: off); `sinks` [Hq] (gpt-oss) add one
    logit per head to each softmax.

    Layout (the worker's KV pool, one layer): sequence `n` keeps position `p` in block
    `block_tables[n, p // B]` at offset `p % B`; each row has one query token, at position
    `seq_lens[n] - 1`, whose K/V are already written. Positions before the window's first one
    (`max(0, seq_len - window)`) are never read, so the cache may free their blocks and point
    their table entries anywhere. The options (Gemma 2/3, Qwen3, OLMo 3, gpt-oss) are runtime
    arguments: a full layer passes `FULL_WINDOW`, which no sequence reaches; `softcap` and `scale`
    are fp32 scalars (Triton never specializes floats) and the cap is one uniform branch per tile
    (`softcap > 0`): a scalar compare per tile instead of a second compiled variant per head dim
    (twice the preflight's compiles and two binaries to keep in step)."""
    n, hq, d = query.shape
    _, hkv, _, bs, _ = kv.shape
    if hq % hkv:
        raise ValueError(f"Query heads `{hq}` must be a multiple of the KV heads `{hkv}`")
    kernel_window, kernel_softcap = _kernel_options(window, softcap)
    if not runs_triton(query) or n == 0:
        return paged_decode_reference(query, kv, block_tables, seq_lens, max_len, window=window, softcap=softcap,
                                      scale=scale, sinks=sinks)  # fmt: skip
    if not kv.is_contiguous():
        raise ValueError(f"The KV cache layer must be contiguous [2, Hkv, NB, B, D], got strides `{kv.stride()}`")
    query = query.contiguous()  # [N, Hq, D]: rows of Hq x D, heads of D
    tables = block_tables.to(torch.int64).contiguous()  # [N, MB]
    out = torch.empty_like(query)  # [N, Hq, D]
    tile, padded, warps = tuning.launch_shape(d)
    sink_values = _no_sinks(query.device) if sinks is None else sinks.float().contiguous()  # [Hq] fp32
    _paged_decode_kernel[(n, hq)](
        query, kv[0], kv[1], out, tables, seq_lens.to(torch.int64), sink_values,
        query.stride(0), kv.shape[2], tables.stride(0), hq // hkv, bs, kernel_window, int(sinks is not None), d,
        kernel_softcap,
        1.0 / math.sqrt(d) if scale is None else float(scale),
        TILE=tile, HEAD_DIM=padded, num_warps=warps,
    )  # fmt: skip
    return out


def compile_specs(tuning: PagedAttentionTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `paged_decode` makes with `tuning` for the workload's head dims: one per
    padded head dim, whatever the window, cap and scale (runtime arguments, see `paged_decode`)."""
    specs = []
    for d in workload.head_dims:
        tile, padded, warps = tuning.launch_shape(d)
        t, index = pointer(workload.dtype), pointer("i64")
        args = (("Q", t), ("K", t), ("V", t), ("Out", t), ("BLOCK_TABLES", index), ("SEQ_LENS", index),
                ("SINKS", pointer("fp32")), *((name, "i32") for name in _UNSPECIALIZED), ("head_dim", int_arg(d)),
                ("softcap", "fp32"), ("scale", "fp32"))
        specs.append(CompileSpec(_paged_decode_kernel, args, (("TILE", tile), ("HEAD_DIM", padded)), warps))
    return unique(specs)
