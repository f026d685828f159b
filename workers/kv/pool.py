"""The KV cache's memory: keys and values of every layer, in fixed-size blocks.

Design: one tensor `[layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]` per KV group
(workers/kv/groups.py); a layer sharing another's KV (Gemma 4) maps to its producer's. Heads
come before blocks (vLLM puts them after) so that a sequence's blocks gathered along the block
axis give, per head, one contiguous `[positions, head_dim]` matrix, the `[N, Hkv, L, D]` operand
SDPA and a per-head GPU tile read, without a second copy; K and V share one tensor so one
`index_select` gathers both. The memory is zero-filled: masked positions and a sliding group's
freed blocks must hold finite values (a masked weight of 0 times NaN is still NaN). Trade-off:
a block's bytes are spread over `2 x kv_heads` places per layer, so nothing copies blocks (a
preempted sequence is recomputed, not swapped out)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

import torch

from workers.kv.groups import KVGroup, same_blocks
from workers.kv.state import StatePool

logger = logging.getLogger(__name__)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVShape(Protocol):
    """The sizes of a model the cache needs (a `ModelConfig` has them)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)
    # where layers differ (Gemma 4; workers/model/layer_shapes.py): each layer's cache (KV heads,
    # head dim), None for a layer reading another's, and the layer whose cache each reads
    layer_kv_shapes: tuple[tuple[int, int] | None, ...]
    kv_sources: tuple[int, ...]


def layer_shapes(config: KVShape) -> tuple[tuple[int, int] | None, ...]:
    """Each layer's cache (KV heads, head dim), None for a layer that reads another's."""
    return getattr(config, "layer_kv_shapes", None) or ((config.num_key_value_heads, config.head_dim),) * (
        config.num_hidden_layers)


class KVPool:
    """Blocks of `block_size` token positions for every layer, one tensor per group of layers
    that attend alike (`workers.kv.groups`): group `g` is `[layers_g, 2, Hkv, NB_g, B, D]`.
    Without `groups`, one full-attention group of `num_layers` layers and `num_blocks` blocks.
    A group's KV heads and head dim are its own (`KVGroup.kv_heads`, `head_dim`; 0: the pool's).
    `sources[i]` is the layer whose cache layer `i` reads (KV sharing; default: itself), which
    holds no blocks of its own. `data`, `num_layers`, `num_blocks`, `num_kv_heads` and `head_dim`
    are the first group's (the full group when the model has one: the group the decode mirror
    copies). `states`: the linear layers' per-sequence state, beside the blocks (workers/kv/state.py)."""

    states: StatePool | None = None

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        groups: tuple[KVGroup, ...] | None = None,
        sources: tuple[int, ...] | None = None,
    ) -> None:
        groups = groups or (KVGroup(None, tuple(range(num_layers)), num_blocks),)
        groups = tuple(replace(g, kv_heads=g.kv_heads or num_kv_heads, head_dim=g.head_dim or head_dim) for g in groups)
        if min(g.num_blocks for g in groups) < 1 or block_size < 1:
            raise ValueError(
                f"A KV pool needs `num_blocks` >= 1 and `block_size` >= 1, got "
                f"`{[g.num_blocks for g in groups]}` and `{block_size}`"
            )
        self.groups, self.block_size = groups, block_size
        self.num_kv_heads, self.head_dim = groups[0].kv_heads, groups[0].head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.tensors = tuple(
            torch.zeros((len(g.layers), 2, g.kv_heads, g.num_blocks, block_size, g.head_dim), dtype=dtype,
                        device=self.device)
            for g in groups
        )  # per group: [L_g, 2, Hkv_g, NB_g, B, D_g]
        self.data = self.tensors[0]
        self.num_layers, self.num_blocks = len(groups[0].layers), groups[0].num_blocks
        # Each group as one flat `[L_g * 2 * Hkv * NB_g * B, D]` view: layers are sliced from it and
        # K/V written into it by one linear index, so a compiled step mutates one graph input per
        # group in place (layer views made outside the graph would be aliased inputs, which
        # torch.compile handles by copying the whole pool: workers/engine/compiled.py).
        self.flats = tuple(t.view(-1, g.head_dim) for t, g in zip(self.tensors, groups, strict=True))
        n_layers = len(sources) if sources else sum(len(g.layers) for g in groups)
        self.sources = tuple(sources or range(n_layers))
        self.group_of: list[int] = [0] * n_layers
        self._local: list[int] = [0] * n_layers
        self._offsets: list[torch.Tensor] = [torch.empty(0)] * n_layers  # [2 * Hkv, 1] first row of K, V heads
        for gi, g in enumerate(groups):
            rows = g.num_blocks * block_size  # rows of one (layer, K or V, head) in the flat view
            for local, index in enumerate(g.layers):
                self.group_of[index], self._local[index] = gi, local
                first = torch.arange(local * 2 * g.kv_heads, (local + 1) * 2 * g.kv_heads, device=self.device)
                self._offsets[index] = (first * rows)[:, None]
        for index, source in enumerate(self.sources):  # a layer sharing KV reads its producer's blocks
            if source != index:
                self.group_of[index], self._local[index] = self.group_of[source], self._local[source]
                self._offsets[index] = self._offsets[source]

    @classmethod
    def for_config(cls, config: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", groups: tuple[KVGroup, ...] | None = None,
                   state_slots: int = 0) -> KVPool:
        """A pool for the model's layers: `groups` as planned (`plan_groups`), or every group of its
        windows with `num_blocks` blocks; a model with linear layers also gets their state for
        `state_slots` sequences (one per sequence running at once)."""
        groups = groups or same_blocks(config.layer_windows, num_blocks, layer_shapes(config))
        pool = cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device, groups, getattr(config, "kv_sources", None))
        if getattr(config, "state_layers", ()):
            if state_slots < 1:
                raise ValueError(f"A model with linear layers needs `state_slots` >= 1 (one per running sequence), "
                                 f"got `{state_slots}`")
            pool.states = StatePool.for_config(config, state_slots, dtype, device)
        return pool

    @staticmethod
    def bytes_per_token(config: KVShape, dtype: torch.dtype) -> int:
        """Bytes one token position occupies across the layers holding a cache (K and V)."""
        return sum(2 * h * d for h, d in filter(None, layer_shapes(config))) * _dtype_size(dtype)

    @staticmethod
    def block_bytes_per_layer(config: KVShape, dtype: torch.dtype, block_size: int) -> tuple[int, ...]:
        """Bytes of one block of each layer (K and V; 0 for a layer reading another's cache)."""
        return tuple(0 if s is None else 2 * s[0] * s[1] * block_size * _dtype_size(dtype)
                     for s in layer_shapes(config))

    def layer(self, index: int) -> torch.Tensor:
        """One layer's K and V: a view `[2, Hkv, NB_g, B, D]` of its group's blocks."""
        g, local = self.group_of[index], self._local[index]
        shape = self.tensors[g].shape[1:]  # [2, Hkv, NB_g, B, D]
        size = shape.numel() // shape[-1]
        return self.flats[g][local * size : (local + 1) * size].view(shape)

    def write(self, index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer `index`'s K and V `[T, Hkv, D]` of `T` tokens at their cache `slots` [T]
        (block * B + offset), in one indexed store into the group's flat view."""
        rows = (self._offsets[index] + slots).flatten()  # [2 * Hkv * T]
        values = torch.stack((k, v)).transpose(1, 2).reshape(-1, k.shape[-1])  # [2 * Hkv * T, D]
        self.flats[self.group_of[index]].index_put_((rows,), values.to(self.dtype))

    @property
    def group_shapes(self) -> tuple[tuple[int | None, int], ...]:
        """(window, blocks) of each group: what the scheduler's block manager mirrors."""
        return tuple((g.window, g.num_blocks) for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention), what `ForwardBatch.build` takes."""
        return tuple(g.window for g in self.groups)

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
