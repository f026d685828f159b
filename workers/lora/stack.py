"""The step's adapters stacked per projection, as the segmented LoRA kernel reads them
(kernels_local/lora_sgmv/): A [L, P*R, K] and B [L, N, R] of the L adapters a batch holds.

Design: a projection's parts (q, k and v of `wqkv`) are the union of the (offset, size) its
adapters target; each adapter's pair of part p lands in A's rank band p*R .. p*R + r and in B's rows
offset .. offset + size, zeros elsewhere, so an adapter of lower rank or fewer targets computes
nothing extra but exact zeros. `StackCache` keeps the stacks of the last few adapter sets (steps
that hold the same adapters reuse them; it holds the adapters while cached, so an id is never
reused under it). Trade-off: a new mix of adapters copies their weights once per projection into a
fresh stack (a copy of what the slots already hold) instead of a paged pool the kernel would index
in place; ranks pad to the set's largest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kernels_local.lora_sgmv.lora_sgmv import RANK_ALIGN, LoraStack
from workers.lora.adapter import LoraAdapter

SETS_KEPT = 4  # adapter sets whose stacks stay cached


def build_stack(adapters: Sequence[LoraAdapter], name: str, device: str | torch.device) -> LoraStack | None:
    """Module `name`'s pairs of `adapters` (slot l = adapters[l]) stacked; None when none targets it."""
    pairs = [a.targets.get(name, ()) for a in adapters]
    if not any(pairs):
        return None
    parts = sorted({(t.offset, t.size) for ps in pairs for t in ps})
    band = {p: i for i, p in enumerate(parts)}
    first = next(t for ps in pairs for t in ps)
    k, dtype = first.a.shape[1], first.a.dtype
    top = max(t.a.shape[0] for ps in pairs for t in ps)
    r = -(-top // RANK_ALIGN) * RANK_ALIGN
    n = max(off + size for off, size in parts)
    a = torch.zeros((len(adapters), len(parts) * r, k), dtype=dtype, device=device)  # [L, P*R, K]
    b = torch.zeros((len(adapters), n, r), dtype=dtype, device=device)  # [L, N, R]
    for slot, ps in enumerate(pairs):
        for t in ps:
            p, rank = band[(t.offset, t.size)], t.a.shape[0]
            a[slot, p * r:p * r + rank] = t.a
            b[slot, t.offset:t.offset + t.size, :rank] = t.b
    scales = torch.tensor([ad.scale for ad in adapters], dtype=torch.float32, device=device)
    offsets = torch.tensor([off for off, _ in parts], dtype=torch.int32, device=device)
    sizes = torch.tensor([size for _, size in parts], dtype=torch.int32, device=device)
    ranks = torch.tensor([-(-max((t.a.shape[0] for t in ps), default=0) // RANK_ALIGN) * RANK_ALIGN
                          for ps in pairs], dtype=torch.int32, device=device)
    return LoraStack(a, b, scales, offsets, sizes, r, max(size for _, size in parts), ranks)


class StackCache:
    """Stacks of the last `SETS_KEPT` adapter sets, built on first use per projection."""

    def __init__(self, kept: int = SETS_KEPT) -> None:
        self._kept = kept
        self._sets: OrderedDict[tuple[int, ...], tuple[tuple[LoraAdapter, ...], dict]] = OrderedDict()

    def get(self, adapters: tuple[LoraAdapter, ...], name: str, device) -> LoraStack | None:
        key = tuple(id(a) for a in adapters)
        entry = self._sets.get(key)
        if entry is None:
            entry = self._sets[key] = (adapters, {})
            while len(self._sets) > self._kept:
                self._sets.popitem(last=False)
        else:
            self._sets.move_to_end(key)
        stacks = entry[1]
        if name not in stacks:
            stacks[name] = build_stack(adapters, name, device)
        return stacks[name]

    def clear(self) -> None:
        self._sets.clear()
