"""Deterministic mode (`--deterministic`): a row's numbers do not depend on its batch mates.

Without it, kernels may pick their reduction order by problem shape (cuBLAS's split-K by row
count, attention splitting keys by length or batch) and prompt rows take another attention path
than decode rows, so in bfloat16 an argmax now and then flips with the batch. Design: every op a
row goes through is a fixed function of that row alone. Projections run in GEMMs of exactly
`ROW_TILE` rows (`install_row_tiles`); attention, prompt and decode rows alike, reads each row's
own cached positions in fixed splits of `KV_SPLIT` from position 0 (`attend_paged`); norms,
activations and sampling are per row already, with element-wise ops kept out of ATen's scalar
tail on the CPU (`tail_free`). What the mode guarantees and how it is tested:
docs/deterministic-and-canary.md. Trade-off: exactness for some throughput (padded row tiles,
K/V gathered for every row, a loop over splits instead of one fused SDPA; docs/benchmarks.md,
"Deterministic mode's cost"), so it is off by default; workers with different kernels still
differ, which the router's canary measures."""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kv.batch import gather_kv

logger = logging.getLogger(__name__)

ROW_TILE = 32  # rows per projection GEMM (CPU and GPU alike: a batch of 32 is one tile)
KV_SPLIT = 64  # cached positions per attention split
SHARED_ROWS = 64  # prompt rows whose K/V split is copied at once (the matmul path: 64 x split x D per KV head)
TAIL_FREE = 128  # elements: a tensor padded to a multiple of this has no scalar tail in ATen's loops
ATTENTION = "fixed splits over the paged cache (torch)"  # `/capability` `deterministic.attention`


@dataclass(frozen=True)
class DeterministicPlan:
    """What `enable_deterministic` changed in a model, for `/capability` and the log."""

    row_tile: int
    kv_split: int
    projections: int  # modules whose rows now go through fixed tiles

    def to_dict(self) -> dict:
        return {"enabled": True, "row_tile": self.row_tile, "kv_split": self.kv_split,
                "attention": ATTENTION, "projections": self.projections}


# -- projections ----------------------------------------------------------------------------


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ in ("Fp8Linear", "Fp8CheckpointLinear",
                                                                     "Int4CheckpointLinear", "GGUFLinear")


def tail_free(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an element-wise `fn` (exp, SiLU, softplus, sigmoid), every element through ATen's
    vector loop: `x` flattened and zero-padded to a multiple of `TAIL_FREE` elements, so no element
    falls in the loop's scalar tail, whose libm functions (exp in SiLU, softplus, sigmoid) may round
    otherwise than the vector code in the last bit. Which elements fall in that tail depends on the
    tensor's size, so on the step's tokens; padded, the same value gives the same bits whatever
    tensor it sits in. The Gated DeltaNet pads its gates, its convolution's SiLU, its gated norm and
    its state's decay so (and sums its convolution's taps in a fixed order); the CPU's C++
    SiluAndMul takes its tail per row instead."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    pad = -n % TAIL_FREE
    return (fn(F.pad(flat, (0, pad)))[:n] if pad else fn(flat)).view(x.shape)


def tiled_rows(forward, x: torch.Tensor, tile: int) -> torch.Tensor:
    """`forward` over the rows of `x` [..., K] in GEMMs of exactly `tile` rows each."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)  # [R, K]
    n = rows.shape[0]
    padded = -(-n // tile) * tile
    if padded != n:
        rows = torch.cat((rows, rows.new_zeros(padded - n, width)))  # [R', K], R' a multiple of tile
    out = torch.cat([forward(rows[i : i + tile]) for i in range(0, padded, tile)]) if padded > tile else forward(rows)
    return out[:n].reshape(*lead, out.shape[-1])


def install_row_tiles(model: nn.Module, tile: int = ROW_TILE) -> int:
    """Make every projection of `model` (whatever forward it has now: torch, a kernel, fp8; the LM
    head included) run in fixed row tiles; returns how many modules changed.

    Every row then meets one GEMM shape, hence one kernel and one reduction over K, whatever the
    step holds. Cost: a step of `r` rows multiplies `ceil(r / tile)` tiles, up to `tile - 1` of
    them padding (a lone decode multiplies 32 rows), and a large prefill runs many tile-sized GEMMs
    instead of one. It also bounds oneDNN's per-shape caches to one shape per weight, so
    workers/model/row_buckets.py is not needed."""
    changed = 0
    for module in model.modules():
        if not _is_projection(module):
            continue
        inner = module.forward  # bound: the kernel's forward when kernelized

        def forward(self, x, _inner=inner):
            return tiled_rows(_inner, x, tile)

        module.forward = types.MethodType(forward, module)
        changed += 1
    return changed


def enable_deterministic(model: nn.Module, row_tile: int = ROW_TILE, kv_split: int = KV_SPLIT) -> DeterministicPlan:
    """Put `model` (loaded, kernelized, quantized: its final modules) in deterministic mode."""
    projections = install_row_tiles(model, row_tile)
    for module in model.modules():
        if hasattr(module, "kv_split"):
            module.kv_split = kv_split
        if hasattr(module, "row_tile"):  # experts (workers/model/moe.py): each expert's rows in fixed tiles
            module.row_tile = row_tile
            projections += 1
        if hasattr(module, "token_by_token"):  # Gated DeltaNet rules: every token one recurrent step, however chunked
            module.token_by_token = True
        if hasattr(module, "tail_free"):  # Gated DeltaNet's gates and convolution: no element in a scalar tail
            module.tail_free = True
    plan = DeterministicPlan(row_tile, kv_split, projections)
    logger.info("deterministic mode: %d projections in %d-row tiles, attention in %d-position splits",
                projections, row_tile, kv_split)
    return plan


# -- attention ------------------------------------------------------------------------------


def attend_paged(q: torch.Tensor, kv: torch.Tensor, batch, split: int = KV_SPLIT, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of a step (decode rows and prompt rows alike) attends to its own sequence's
    cached positions `0..p` (the last `window` of them on a sliding layer), read back from the
    paged cache, through `split_attention`.

    Splits have a fixed size counted from position 0 (flash-decoding with a fixed split size, not
    a fixed number of splits): each split's scores are one `[G, D] x [D, split]` problem per (row,
    KV head) with the split's own maximum, and the partial results merge by their log-sum-exp in
    split order, in fp32; positions past a row's length are masked to exact zeros, so padding to a
    batch mate's length adds nothing. Prompt and decode rows go through this one function, so
    chunked prefill, a prefix-cache hit and a recomputation all give a row the numbers of one whole
    prefill; it is the same torch path on every device (the GPU paged-attention kernel serves
    decode rows only). Cost: every row's K/V are gathered (no CPU decode mirror), and a prompt of
    `n` tokens attends about `n^2 / (2 split)` row-splits where SDPA makes one fused call.

    `q` [T, Hq, D]; `kv` one layer's blocks [2, Hkv, NB, B, D] with this step's K/V written;
    `batch` the step's `ForwardBatch` -> [T, Hq, D] in `q`'s dtype."""
    hkv, d = kv.shape[1], kv.shape[-1]
    out = torch.empty_like(q)
    decode = batch.decode
    if decode is not None:
        k, v = decode.gather(kv)  # [Nd, Hkv, L, D]
        qd = q.index_select(0, decode.rows).view(decode.num, hkv, -1, d)
        o = split_attention(qd, k, v, decode.seq_lens.tolist(), split, window, scale, softcap, sinks)
        out.index_copy_(0, decode.rows, o.to(q.dtype).flatten(1, 2))
    for span in batch.prefills:
        end = span.start_pos + span.num_tokens
        table = torch.tensor([span.table], dtype=torch.int64, device=q.device)
        k, v = gather_kv(kv, table, end)  # [1, Hkv, end, D]
        rows = slice(span.row_start, span.row_start + span.num_tokens)
        o = split_attention(q[rows].view(span.num_tokens, hkv, -1, d), k, v, list(range(span.start_pos + 1, end + 1)),
                            split, window, scale, softcap, sinks)
        out[rows] = o.to(q.dtype).flatten(1, 2)
    return out


def _positions(t: torch.Tensor, start: int, split: int) -> torch.Tensor:
    """Positions `start .. start+split-1` of `t` [N, Hkv, L, D]: a view while `t` has them (a cache
    holds finite values past a row's end, which the mask hides), else zero-padded."""
    part = t[:, :, start : start + split]
    if part.shape[2] < split:
        part = torch.nn.functional.pad(part, (0, 0, 0, split - part.shape[2]))
    return part


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
             softcap: float | None):
    """One split: softmax attention of `q` [R, Hkv, G, D] over `k`, `v` [R, Hkv, S, D] with `mask`
    [R, 1, 1, S] (True = attend) -> (out [R, Hkv, G, D] fp32, logsumexp [R, Hkv, G] fp32)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # the fused CPU kernel: one [G, D] x [D, S] problem per (row, KV head)
    if q.device.type == "cpu" and softcap is None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                              scale=scale)
        return out.float(), lse
    if k.shape[0] > 1 and k.stride(0) == 0:  # a prompt's rows share one sequence's K/V (expanded, stride 0)
        # multiplied as decode rows are, each row its own copy: a stride-0 batch takes another GEMM path
        # whose sums differ in the last bits (MKL on AVX2), so a verified draft would not be a decode's
        parts = [_partial(q[i:i + SHARED_ROWS], k[i:i + SHARED_ROWS].contiguous(), v[i:i + SHARED_ROWS].contiguous(),
                          mask[i:i + SHARED_ROWS], scale, softcap) for i in range(0, q.shape[0], SHARED_ROWS)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [R, Hkv, G, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1).nan_to_num_(0.0), v.float()), lse


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                    split: int = KV_SPLIT, window: int | None = None, scale: float | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query token per row in fixed splits of `split` positions.

    `q` [R, Hkv, G, D] (the G query heads of each KV head), `k`, `v` [R or 1, Hkv, L, D]
    (1: every row reads the same sequence, a prompt chunk, whose `lens` ascend), `lens[r]` the
    positions row `r` attends (its position + 1; L >= max(lens)), the last `window` of them when
    it slides -> [R, Hkv, G, D] in fp32. Row `r`'s result depends only on `q[r]`, its keys and
    values, and `split`: each split is attended by one [G, D] x [D, split] problem per (row, KV
    head), whatever the other rows, and the splits are merged by their log-sum-exp in split
    order (a split a row does not see weighs exactly nothing); `sinks` [Hq] (gpt-oss) join the
    merge as one more logit per head that adds weight and no value."""
    rows = q.shape[0]
    shared = k.shape[0] == 1 and rows > 1
    lens_t = torch.tensor(lens, device=q.device)
    lows = [0 if window is None else max(0, n - window) for n in lens]
    lows_t = torch.tensor(lows, device=q.device)
    offsets = torch.arange(split, device=q.device)
    outs, lses, firsts = [], [], []
    for start in range(min(lows) // split * split, max(lens), split):
        # 1. the rows that reach this split (a leading run of rows that do not is skipped)
        first = next(r for r, n in enumerate(lens) if n > start)
        ks, vs = _positions(k, start, split), _positions(v, start, split)
        if shared:
            ks, vs = ks.expand(rows - first, -1, -1, -1), vs.expand(rows - first, -1, -1, -1)  # stride 0: no copy
        else:
            ks, vs = ks[first:], vs[first:]
        pos = offsets + start
        mask = ((pos < lens_t[first:, None]) & (pos >= lows_t[first:, None]))[:, None, None, :]  # [R', 1, 1, split]
        out, lse = _partial(q[first:], ks, vs, mask, scale, softcap)
        # 2. a row that sees nothing of this split (inside the rows kept) weighs nothing in it
        blind = ~mask.any(dim=-1)  # [R', 1, 1]
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind.unsqueeze(-1), 0.0)
        outs.append(out)
        lses.append(lse)
        firsts.append(first)
    # 3. merge the splits by their log-sum-exp, in split order (exact zeros for skipped rows)
    top = lses[0]
    for lse, first in zip(lses[1:], firsts[1:], strict=True):
        top = torch.cat((top[:first], torch.maximum(top[first:], lse)))
    acc = torch.zeros_like(outs[0])
    total = torch.zeros_like(top)
    if sinks is not None:
        sink = sinks.float().view(1, *top.shape[1:])  # [1, Hkv, G]
        top = torch.maximum(top, sink)
        total = total + torch.exp(sink - top)
    for out, lse, first in zip(outs, lses, firsts, strict=True):
        weight = torch.exp(lse - top[first:])  # [R', Hkv, G]
        acc[first:] += weight.unsqueeze(-1) * out.nan_to_num(0.0)
        total[first:] += weight
    return acc / total.unsqueeze(-1)
