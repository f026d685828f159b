"""KV cache groups: layers that attend alike share a block table; a sliding group frees its past.

Design (vLLM's hybrid allocator, one block pool per attention type): the model's layers are
grouped by the positions they attend, full attention in one group, each sliding window `W`
in another. A group has its own blocks (its own memory, its own `BlockPool`) and each
sequence one block table per group, all indexed alike by position. A full group keeps a
sequence's every block. A sliding group frees a block as soon as no later query can see it:
the next query at position `q` sees `q - W + 1 .. q`, so blocks wholly before `q - W + 1`
go back to the pool (with their prefix-cache hash, as any freed block). So what one sequence
holds in a sliding group is bounded by its window (`window_blocks`), plus the chunk it is
computing. Its table keeps its length: freed leading entries stay as placeholders that no
kernel reads (decode starts at `q - W + 1`; the torch path gathers only the window).

Why separate pools rather than one pool whose blocks every layer indexes: a block id shared
by all layers cannot be freed for the sliding layers while the full ones still need it. The
trade-off: the memory is split once at start (`plan_groups`): a sliding group gets what
`max_sequences` windows plus one step's new tokens need, the rest goes to the full group,
and a sliding group short of blocks preempts like any other shortage. A prefix hit must hold
every full block and, in a sliding group, the blocks of the last `W` positions before the
first computed token (`Groups.hit_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers attending alike: their window (None: all positions) and their blocks."""

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int


def layer_groups(windows: Sequence[int | None]) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """(window, layers) per group for the layers' windows: the full group first, then each window."""
    order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple((w, tuple(i for i, x in enumerate(windows) if x == w)) for w in order)


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks the last `window` positions of a sequence span (they rarely start a block)."""
    return -(-(window - 1) // block_size) + 1


def first_needed(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` (or any later one) reads in a group of `window`."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def plan_groups(windows: Sequence[int | None], block_bytes_per_layer: int, budget: int, block_size: int,
                max_sequences: int, max_batched_tokens: int) -> tuple[KVGroup, ...]:
    """Split a budget between the groups of the layers' `windows`: a sliding group gets what
    `max_sequences` windows and one step's `max_batched_tokens` new tokens need (never more
    blocks than the full group), the full group the rest. `block_bytes_per_layer`: one block of
    one layer (K and V). One group only: all of the budget."""
    groups = layer_groups(windows)
    if len(groups) == 1:
        w, layers = groups[0]
        return (KVGroup(w, layers, budget // (block_bytes_per_layer * len(layers))),)
    total_layers = sum(len(layers) for _, layers in groups)
    even = budget // (block_bytes_per_layer * total_layers)  # every group the same blocks
    caps = {w: max_sequences * (window_blocks(w, block_size) + 1) + -(-max_batched_tokens // block_size)
            for w, _ in groups if w is not None}
    sliding = {w: min(even, cap) for w, cap in caps.items()}
    spent = sum(sliding[w] * len(layers) for w, layers in groups if w is not None) * block_bytes_per_layer
    full_layers = sum(len(layers) for w, layers in groups if w is None)
    if full_layers:
        full = (budget - spent) // (block_bytes_per_layer * full_layers)
        return tuple(KVGroup(w, layers, full if w is None else sliding[w]) for w, layers in groups)
    # only sliding groups (several windows): what they need, the rest evenly
    left = (budget - spent) // (block_bytes_per_layer * total_layers)
    return tuple(KVGroup(w, layers, sliding[w] + left) for w, layers in groups)


def same_blocks(windows: Sequence[int | None], num_blocks: int) -> tuple[KVGroup, ...]:
    """Every group with `num_blocks` blocks (tests, benchmarks: a pool sized in blocks)."""
    return tuple(KVGroup(w, layers, num_blocks) for w, layers in layer_groups(windows))
