"""The KV cache's memory: keys and values of every layer, in fixed-size blocks.

Layout: one tensor `[layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]`. Why
heads before blocks (vLLM puts them after): a sequence's blocks gathered along the block
axis give, per head, one contiguous `[blocks x block_size, head_dim]` matrix, so the block
and in-block axes merge into one position axis without a second copy, which is the
`[N, Hkv, L, D]` operand SDPA (and a per-head GPU tile) reads. K and V of a layer sit in
one tensor so one `index_select` gathers both. Trade-off: one block's bytes are spread over
`2 x kv_heads` places per layer, so copying a single block would take that many copies;
nothing here copies blocks (a preempted sequence is recomputed, not swapped out).

The memory is zero-filled: positions past a sequence's length are masked in attention, but
must hold finite values (a masked weight of 0 times NaN is still NaN).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVShape(Protocol):
    """The three sizes of a model the cache needs (a `ModelConfig` has them)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


class KVPool:
    """`num_blocks` blocks of `block_size` token positions, for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"A KV pool needs `num_blocks` >= 1 and `block_size` >= 1, got `{num_blocks}` and `{block_size}`"
            )
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, 2, Hkv, NB, B, D]

    @classmethod
    def for_config(cls, config: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> KVPool:
        return cls(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                   config.head_dim, dtype, device)

    @staticmethod
    def bytes_per_token(config: KVShape, dtype: torch.dtype) -> int:
        """Bytes one token position occupies across all layers (K and V)."""
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * _dtype_size(dtype)

    def layer(self, index: int) -> torch.Tensor:
        """One layer's K and V: a view `[2, Hkv, NB, B, D]`."""
        return self.data[index]

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
