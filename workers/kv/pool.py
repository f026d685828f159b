"""The KV cache's memory: keys and values of every layer, in fixed-size blocks.

Layout: one tensor `[layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]` per group
of layers that attend alike (full attention, each sliding window: `workers.kv.groups`). Why
heads before blocks (vLLM puts them after): a sequence's blocks gathered along the block
axis give, per head, one contiguous `[blocks x block_size, head_dim]` matrix, so the block
and in-block axes merge into one position axis without a second copy, which is the
`[N, Hkv, L, D]` operand SDPA (and a per-head GPU tile) reads. K and V of a layer sit in
one tensor so one `index_select` gathers both. Trade-off: one block's bytes are spread over
`2 x kv_heads` places per layer, so copying a single block would take that many copies;
nothing here copies blocks (a preempted sequence is recomputed, not swapped out).

The memory is zero-filled: positions past a sequence's length are masked in attention, but
must hold finite values (a masked weight of 0 times NaN is still NaN); so must a sliding
group's freed blocks, which its placeholders still name.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from workers.kv.groups import KVGroup, same_blocks

logger = logging.getLogger(__name__)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVShape(Protocol):
    """The sizes of a model the cache needs (a `ModelConfig` has them)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)


class KVPool:
    """Blocks of `block_size` token positions for every layer, one tensor per group of layers
    that attend alike (`workers.kv.groups`): group `g` is `[layers_g, 2, Hkv, NB_g, B, D]`.
    Without `groups`, one full-attention group of `num_layers` layers and `num_blocks` blocks.
    `data`, `num_layers` and `num_blocks` are the first group's (the full group when the model
    has one: the group the decode mirror copies)."""

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
    ) -> None:
        groups = groups or (KVGroup(None, tuple(range(num_layers)), num_blocks),)
        if min(g.num_blocks for g in groups) < 1 or block_size < 1:
            raise ValueError(
                f"A KV pool needs `num_blocks` >= 1 and `block_size` >= 1, got "
                f"`{[g.num_blocks for g in groups]}` and `{block_size}`"
            )
        self.groups, self.block_size = groups, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.tensors = tuple(
            torch.zeros((len(g.layers), 2, num_kv_heads, g.num_blocks, block_size, head_dim), dtype=dtype,
                        device=self.device)
            for g in groups
        )  # per group: [L_g, 2, Hkv, NB_g, B, D]
        self.data = self.tensors[0]
        self.num_layers, self.num_blocks = len(groups[0].layers), groups[0].num_blocks
        # Each group as one flat `[L_g * 2 * Hkv * NB_g * B, D]` view: layers are sliced from it and
        # K/V written into it by one linear index, so a compiled step mutates one graph input per
        # group in place (layer views made outside the graph would be aliased inputs, which
        # torch.compile handles by copying the whole pool: workers/engine/compiled.py).
        self.flats = tuple(t.view(-1, head_dim) for t in self.tensors)
        n_layers = sum(len(g.layers) for g in groups)
        self.group_of: list[int] = [0] * n_layers
        self._local: list[int] = [0] * n_layers
        self._offsets: list[torch.Tensor] = [torch.empty(0)] * n_layers  # [2 * Hkv, 1] first row of K, V heads
        for gi, g in enumerate(groups):
            rows = g.num_blocks * block_size  # rows of one (layer, K or V, head) in the flat view
            for local, index in enumerate(g.layers):
                self.group_of[index], self._local[index] = gi, local
                first = torch.arange(local * 2 * num_kv_heads, (local + 1) * 2 * num_kv_heads, device=self.device)
                self._offsets[index] = (first * rows)[:, None]

    @classmethod
    def for_config(cls, config: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", groups: tuple[KVGroup, ...] | None = None) -> KVPool:
        """A pool for the model's layers: `groups` as planned (`plan_groups`), or every group of its
        windows with `num_blocks` blocks."""
        groups = groups or same_blocks(config.layer_windows, num_blocks)
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device, groups)

    @staticmethod
    def bytes_per_token(config: KVShape, dtype: torch.dtype) -> int:
        """Bytes one token position occupies across all layers (K and V)."""
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * _dtype_size(dtype)

    @staticmethod
    def block_bytes_per_layer(config: KVShape, dtype: torch.dtype, block_size: int) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * config.num_key_value_heads * config.head_dim * block_size * _dtype_size(dtype)

    def layer(self, index: int) -> torch.Tensor:
        """One layer's K and V: a view `[2, Hkv, NB_g, B, D]` of its group's blocks."""
        g, local = self.group_of[index], self._local[index]
        shape = self.tensors[g].shape[1:]  # [2, Hkv, NB_g, B, D]
        size = shape.numel() // self.head_dim
        return self.flats[g][local * size : (local + 1) * size].view(shape)

    def write(self, index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer `index`'s K and V `[T, Hkv, D]` of `T` tokens at their cache `slots` [T]
        (block * B + offset), in one indexed store into the group's flat view."""
        rows = (self._offsets[index] + slots).flatten()  # [2 * Hkv * T]
        values = torch.stack((k, v)).transpose(1, 2).reshape(-1, self.head_dim)  # [2 * Hkv * T, D]
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
