"""KV cache groups: layers that attend alike share a block table; a sliding group frees its past.

Design (vLLM's hybrid allocator, one block pool per attention type): layers are grouped by the
positions they attend and by their cache shape (KV heads, head dim: Gemma 4's sliding and global
layers differ). Each group has its own blocks and each sequence one table per group, indexed
alike by position. A sliding group of window `W` frees a block once no later query can see it,
so a sequence holds about its window there (`window_blocks`); freed entries stay in the table as
placeholders no kernel reads. A layer reading another layer's cache (Gemma 4's KV sharing)
belongs to no group. Trade-off: separate pools, because a block id shared by every layer could
not be freed for the sliding layers while the full ones read it; the memory is then split once at
start (`plan_groups`: a sliding group gets what `max_sequences` windows and one step's tokens
need, the full group the rest), and a prefix hit must hold every full block and the window's
blocks before the first computed token (`Groups.hit_length`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Shape = tuple[int, int]  # a layer's cache: (KV heads, head dim)


@dataclass(frozen=True)
class KVGroup:
    """Layers attending alike: their window (None: all positions), their blocks and their cache
    shape (KV heads, head dim; 0: the pool's)."""

    window: int | None
    layers: tuple[int, ...]
    num_blocks: int
    kv_heads: int = 0
    head_dim: int = 0


def layer_groups(windows: Sequence[int | None],
                 shapes: Sequence[Shape | None] | None = None) -> tuple[tuple[int | None, tuple[int, ...]], ...]:
    """(window, layers) per group for the layers' windows (and cache `shapes`, None for a layer
    reading another's cache, which joins no group): the full groups first, then each window."""
    shapes = shapes or [(0, 0)] * len(windows)
    keys = {(w, s) for w, s in zip(windows, shapes, strict=True) if s is not None}
    order = sorted(keys, key=lambda k: (k[0] is not None, k[0] or 0, k[1]))
    return tuple((w, tuple(i for i, key in enumerate(zip(windows, shapes, strict=True)) if key == (w, s)))
                 for w, s in order)


def window_blocks(window: int, block_size: int) -> int:
    """Most blocks the last `window` positions of a sequence span (they rarely start a block)."""
    return -(-(window - 1) // block_size) + 1


def first_needed(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` (or any later one) reads in a group of `window`."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def _group(window: int | None, layers: tuple[int, ...], blocks: int, shapes) -> KVGroup:
    return KVGroup(window, layers, blocks, *(shapes[layers[0]] if shapes else (0, 0)))


UNBOUNDED_BLOCKS = 2**40  # a group that costs nothing here (a pipeline stage holds none of its layers)


def plan_groups(windows: Sequence[int | None], block_bytes_per_layer: int | Sequence[int], budget: int,
                block_size: int, max_sequences: int, max_batched_tokens: int,
                shapes: Sequence[Shape | None] | None = None) -> tuple[KVGroup, ...]:
    """Split a budget between the groups of the layers' `windows` (and cache `shapes`): a sliding
    group gets what `max_sequences` windows and one step's `max_batched_tokens` new tokens need
    (never more blocks than an even split), the full groups the rest, the same blocks each.
    `block_bytes_per_layer`: one block of one layer (K and V), or each layer's own (its shape's;
    0 for a layer held elsewhere, by another pipeline stage: a group of only such layers gets
    `UNBOUNDED_BLOCKS`, and the others share the budget as if it were not there). One group only:
    all of the budget."""
    groups = layer_groups(windows, shapes)
    per_layer = (lambda i: block_bytes_per_layer) if isinstance(block_bytes_per_layer, int) else (
        lambda i: block_bytes_per_layer[i])
    cost = [sum(per_layer(i) for i in layers) for _, layers in groups]  # one block in every layer of a group
    held = [g for g, c in enumerate(cost) if c > 0]
    blocks = _split(groups, cost, held, budget, block_size, max_sequences, max_batched_tokens)
    return tuple(_group(w, layers, blocks.get(g, UNBOUNDED_BLOCKS), shapes) for g, (w, layers) in enumerate(groups))


def _split(groups, cost, held, budget, block_size, max_sequences, max_batched_tokens) -> dict[int, int]:
    """Each held group's blocks (see `plan_groups`)."""
    if not held:  # a pipeline stage of linear-attention layers only: no KV here at all
        return {}
    if len(held) == 1:
        return {held[0]: budget // cost[held[0]]}
    even = budget // sum(cost[g] for g in held)  # every group the same blocks
    blocks = {g: min(even, max_sequences * (window_blocks(groups[g][0], block_size) + 1) + -(-max_batched_tokens //
                                                                                           block_size))
              for g in held if groups[g][0] is not None}
    spent = sum(blocks[g] * cost[g] for g in blocks)
    full_cost = sum(cost[g] for g in held if g not in blocks)
    if full_cost:
        full = (budget - spent) // full_cost
        return {g: blocks.get(g, full) for g in held}
    # only sliding groups (several windows): what they need, the rest evenly
    left = (budget - spent) // sum(cost[g] for g in held)
    return {g: blocks[g] + left for g in held}


def same_blocks(windows: Sequence[int | None], num_blocks: int,
                shapes: Sequence[Shape | None] | None = None) -> tuple[KVGroup, ...]:
    """Every group with `num_blocks` blocks (tests, benchmarks: a pool sized in blocks)."""
    return tuple(_group(w, layers, num_blocks, shapes) for w, layers in layer_groups(windows, shapes))
