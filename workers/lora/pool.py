"""The worker's adapter pool: `--max-loras` slots of preallocated memory per projection on the model's
device, which the segmented LoRA kernel (kernels_local/lora_sgmv/) reads in place.

Design: each projection an adapter targets gets, on first use, one `LoraStack` of `slots` slots in
the kernel's layout (A [L, P*R, K], B [L, N, R], fp32 scales [L]), with P the projection's fixed
parts (q, k, v of `wqkv`; gate, up of `w_gate_up`; the whole output of `wo` and `w_down`) and R
`--max-lora-rank` rounded up to the kernel's rank alignment. `write(slot, adapter)` zeroes the slot
in every projection and copies the adapter's pairs into it (the only copy of adapter weights on the
device), and returns the adapter as the step reads it: its pairs are views into the slot and it
carries the slot, so a step's segments index the pool directly and no step gathers or copies
adapter weights, whatever the mix. A part or rank an adapter lacks stays zeros, which add exact
zeros, and each projection's `ranks` gives the kernel the slot's own rank there (0: not targeted),
so it computes no band past it. On the torch path (a CPU worker) a step of several adapters whose
rows are few each (decode rows spread over adapters) is computed from the pool in a handful of ops
for all of them (`add_pooled`: one shrink over every slot, each row's own band taken, one batched
expand), rather than a gather, matmuls and a scatter per adapter and part. Trade-off: every slot's
memory is sized for the highest accepted rank and every part of each projection (vLLM's layout),
taken after the KV cache (slots that do not fit are a named `LoraError` at load), and `add_pooled`
multiplies every slot (zeros included) for every row; in exchange a mix of adapters costs nothing
to set up.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kernels_local.lora_sgmv.lora_sgmv import RANK_ALIGN, LoraSegments, LoraStack
from workers.lora.adapter import LoraAdapter, LoraError, LoraTarget, is_projection
from workers.model.config import ModelConfig
from workers.model.weights import _part_sizes


def pool_rank(max_rank: int) -> int:
    """A slot's rank band: `max_rank` rounded up to the kernel's alignment."""
    return -(-max_rank // RANK_ALIGN) * RANK_ALIGN


class LoraPool:
    """`slots` adapters' pairs per projection of `model` (built for `config`), in `dtype` on `device`."""

    def __init__(self, model: nn.Module, config: ModelConfig, slots: int, max_rank: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.slots, self.rank, self.dtype, self.device = slots, pool_rank(max_rank), dtype, torch.device(device)
        self._config = config
        self._layers = {n: m for n, m in model.named_modules() if is_projection(m)}
        self._stacks: dict[str, LoraStack] = {}
        self._scales = torch.zeros(slots, dtype=torch.float32, device=self.device)

    @property
    def nbytes(self) -> int:
        """Device memory the allocated projections hold."""
        return sum(s.a.nbytes + s.b.nbytes for s in self._stacks.values()) + self._scales.nbytes

    def stack(self, name: str) -> LoraStack | None:
        """Projection `name`'s stack of every slot (None: no adapter written here targets it yet)."""
        return self._stacks.get(name)

    def write(self, slot: int, adapter: LoraAdapter) -> LoraAdapter:
        """Copy `adapter` (any device) into `slot`, over whatever it held; the adapter as steps read it."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"LoRA pool slot `{slot}` does not exist. Accepted: 0..{self.slots - 1}")
        for stack in self._stacks.values():
            stack.a[slot].zero_()
            stack.b[slot].zero_()
            stack.ranks[slot] = 0
        views: dict[str, tuple[LoraTarget, ...]] = {}
        for name, pairs in adapter.targets.items():
            stack = self._stacks.get(name) or self._allocate(name)
            band = {int(off): p for p, off in enumerate(stack.part_offsets.tolist())}
            placed = []
            for t in pairs:
                p, rank = band[t.offset], t.a.shape[0]
                a = stack.a[slot, p * self.rank:p * self.rank + rank]  # [r, K], contiguous
                b = stack.b[slot, t.offset:t.offset + t.size, :rank]  # [size, r], a strided view
                a.copy_(t.a, non_blocking=True)
                b.copy_(t.b, non_blocking=True)
                placed.append(LoraTarget(t.offset, t.size, a, b))
            views[name] = tuple(placed)
            stack.ranks[slot] = pool_rank(max(t.a.shape[0] for t in pairs))
        self._scales[slot] = adapter.scale
        experts = {name: x.to(self.device) for name, x in adapter.experts.items()}  # beside the slots
        return replace(adapter, targets=views, slot=slot, experts=experts)

    def _allocate(self, name: str) -> LoraStack:
        layer = self._layers[name]
        try:
            sizes = _part_sizes(self._config, f"{name}.weight")
        except KeyError:  # an unfused projection: one part, its whole output
            sizes = (layer.out_features,)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        r, k, n = self.rank, layer.in_features, layer.out_features
        try:
            a = torch.zeros((self.slots, len(sizes) * r, k), dtype=self.dtype, device=self.device)
            b = torch.zeros((self.slots, n, r), dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError:
            need = self.slots * r * (len(sizes) * k + n) * self.dtype.itemsize
            raise LoraError(f"LoRA pool: no device memory for the {self.slots} slots of `{name}` ({need} bytes at "
                            f"rank {r}). Accepted: fewer `--max-loras`, a lower `--max-lora-rank`, or a lower "
                            f"`--gpu-memory-utilization`") from None
        stack = LoraStack(
            a, b,
            self._scales,
            torch.tensor(offsets, dtype=torch.int32, device=self.device),
            torch.tensor(sizes, dtype=torch.int32, device=self.device),
            r, max(sizes), torch.zeros(self.slots, dtype=torch.int32, device=self.device))
        self._stacks[name] = stack
        return stack


POOLED_MAX_ROWS = 16  # per adapter: a step whose segments are all this short takes `add_pooled` on the torch path


def pooled_fits(stack: LoraStack, segments: LoraSegments) -> bool:
    """Whether `add_pooled` serves this step: several adapters, each with few rows (its extra work, a
    shrink and an expand over every slot, stays below the per-adapter path's op count)."""
    return segments.loras.numel() > 1 and segments.max_rows <= POOLED_MAX_ROWS and stack.a.device.type == "cpu"


def add_pooled(stack: LoraStack, rows: torch.Tensor, slot: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
    """`out[row, part] += scale[slot] * (x[row] @ A[slot]^T) @ B[slot]^T` for each of `rows` (int64)
    with its `slot` (int64), in place, from the pool's stack: T over every slot in one matmul, each
    row's own slot's band taken, the expand as one batched matmul over slots (zeros for the slots a
    row does not use)."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    n, (slots, width, k) = rows.numel(), stack.a.shape
    xs = x2.index_select(0, rows).to(stack.a.dtype)  # [n, K]
    every = (xs @ stack.a.view(slots * width, k).T).view(n, slots, width)  # [n, L, P*R]
    own = torch.arange(n, device=rows.device)
    wide = torch.zeros((slots, n, width), dtype=every.dtype, device=every.device)
    wide[slot, own] = every[own, slot]  # each row's T in its own slot's plane, zeros in the others
    scale = stack.scales.index_select(0, slot).to(stack.b.dtype)[:, None]  # [n, 1]
    r = stack.rank
    for p, (off, size) in enumerate(zip(stack.part_offsets.tolist(), stack.part_sizes.tolist(), strict=True)):
        if size == 0:
            continue
        b = stack.b[:, off:off + size, :].transpose(1, 2)  # [L, R, size], a view
        delta = torch.bmm(wide[:, :, p * r:(p + 1) * r], b).sum(0) * scale  # [n, size]
        out2.narrow(1, off, size).index_add_(0, rows, delta.to(out2.dtype))
