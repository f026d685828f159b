"""Per-sequence state of linear-attention layers, beside the paged KV cache.

Design (vLLM's "mamba" cache, one slot per running sequence): a Gated DeltaNet layer keeps per
sequence the last `K - 1` inputs of its convolution (model dtype) and its recurrent state
`[Hv, Dk, Dv]` in fp32 (it sums every token's update, which bf16 would round away). `StatePool`
holds both for every linear layer and `num_slots` sequences, allocated once and counted in the
memory budget (`plan_state`); `StateSlots` hands a slot out at admission and takes it back with
the sequence's blocks, so it cannot leak apart from them. A first chunk starts from zeros
(`StateBatch.fresh`), every later chunk reads the slot and writes it back. A prefix is reused
only where a snapshot of the state at its end exists, kept in spare slots after the running
ones (workers/kv/snapshots.py: a snapshot is a whole sequence's state, so they are taken at
sparse block boundaries, not per block). Trade-off: the state memory stays bounded by
`num_slots`, running and spare, whatever the number of cached prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

RECURRENT_DTYPE = torch.float32  # the recurrent state's dtype, whatever the model's


class StateShape(Protocol):
    """The sizes of a model the state pool needs (a `ModelConfig` has them)."""

    state_layers: tuple[int, ...]  # the linear-attention layers
    linear_conv_dim: int  # channels of the convolution (q, k and v)
    linear_conv_kernel: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StatePool:
    """Conv and recurrent state of every linear layer for `num_slots` sequences: `conv`
    `[L, S, C, K-1]` in the model's dtype, `recurrent` `[L, S, Hv, Dk, Dv]` fp32."""

    recorder = None  # during a step with drafted rows: what rolls their state back (workers/model/state_rollback.py)

    def __init__(self, layers: Sequence[int], num_slots: int, conv_dim: int, conv_kernel: int, heads: int,
                 key_dim: int, value_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        if num_slots < 1 or not layers:
            raise ValueError(f"A state pool needs `num_slots` >= 1 and linear layers, got `{num_slots}` and "
                             f"`{list(layers)}`")
        self.layers, self.num_slots, self.dtype = tuple(layers), num_slots, dtype
        self.device = torch.device(device)
        self.conv = torch.zeros((len(layers), num_slots, conv_dim, conv_kernel - 1), dtype=dtype, device=self.device)
        self.recurrent = torch.zeros((len(layers), num_slots, heads, key_dim, value_dim), dtype=RECURRENT_DTYPE,
                                     device=self.device)  # fmt: skip
        self._local = {layer: i for i, layer in enumerate(self.layers)}

    @classmethod
    def for_config(cls, config: StateShape, num_slots: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> StatePool:  # fmt: skip
        return cls(config.state_layers, num_slots, config.linear_conv_dim, config.linear_conv_kernel,
                   config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim, dtype,
                   device)  # fmt: skip

    @staticmethod
    def bytes_per_sequence(config: StateShape, dtype: torch.dtype) -> int:
        """Bytes one sequence's state occupies across all linear layers (0 without any)."""
        conv = config.linear_conv_dim * (config.linear_conv_kernel - 1) * _size(dtype)
        recurrent = (config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
                     * _size(RECURRENT_DTYPE))  # fmt: skip
        return len(config.state_layers) * (conv + recurrent)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s conv state `[S, C, K-1]` and recurrent state `[S, Hv, Dk, Dv]` (views)."""
        local = self._local[index]
        return self.conv[local], self.recurrent[local]

    def copy_slot(self, src: int, dst: int) -> None:
        """Every linear layer's state of slot `src` into slot `dst` (a snapshot taken or restored:
        workers/kv/snapshots.py)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def clear(self, index: int, slots: torch.Tensor) -> None:
        """Zero layer `index`'s state in `slots` [n] (sequences starting in this step)."""
        conv, recurrent = self.layer(index)
        conv.index_fill_(0, slots, 0)
        recurrent.index_fill_(0, slots, 0)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


class StateSlots:
    """The scheduler's side: which slots are free (plain CPU bookkeeping, like `BlockPool`)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"`num_slots` must be >= 1, got `{num_slots}`")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def give(self, slot: int) -> None:
        if slot not in self._held:
            raise AssertionError(f"State slot `{slot}` given back but not held")
        self._held.remove(slot)
        self._free.append(slot)


@dataclass(frozen=True, eq=False)
class StateBatch:
    """The step's chunks as the linear layers see them: decode rows (one token each) and prefill
    spans (several), each with its sequence's slot, in `ForwardBatch`'s orders."""

    decode_slots: torch.Tensor | None  # [Nd] slot of each decode row
    prefill_slots: tuple[int, ...]  # slot of each prefill span (host ints: the torch path loops over spans)
    prefills: torch.Tensor | None  # [P, 3] row start, tokens, slot of each span (for the kernels)
    fresh: torch.Tensor | None  # [F] slots whose sequence starts in this step: cleared before use

    @classmethod
    def build(cls, chunks: Sequence, device: torch.device | str = "cpu") -> StateBatch | None:
        """From the step's `SeqChunk`s in batch order (their `state_slot`); None when they have none
        (the first chunk's -1 says so for all of them: a model's chunks all have a slot or none do)."""
        if chunks[0].state_slot < 0:  # a model without linear layers (its chunks all carry -1)
            return None
        slots = [c.state_slot for c in chunks]
        if min(slots) < 0:
            raise ValueError(f"Every chunk of a model with linear layers needs a `state_slot`, got `{slots}`")
        decode, spans, fresh, row = [], [], [], 0
        for c in chunks:  # one token: a decode row; more: a prefill span (as `ForwardBatch.build` splits them)
            if c.num_tokens == 1:
                decode.append(c.state_slot)
            else:
                spans.extend((row, c.num_tokens, c.state_slot))
            if c.start_pos == 0:
                fresh.append(c.state_slot)
            row += c.num_tokens
        data = torch.tensor(decode + spans + fresh, dtype=torch.int64, device=device)  # one copy, then views
        nd, ns = len(decode), len(spans)
        return cls(data[:nd] if nd else None, tuple(spans[2::3]), data[nd : nd + ns].view(-1, 3) if ns else None,
                   data[nd + ns :] if fresh else None)  # fmt: skip


def plan_state(config: StateShape, dtype: torch.dtype, max_sequences: int, budget: int) -> tuple[int, str]:
    """(bytes, description) of the state of `max_sequences` slots, taken from `budget` first;
    raises when they alone do not fit it. (0, "") for a model without linear layers."""
    per_sequence = StatePool.bytes_per_sequence(config, dtype) if config.state_layers else 0
    if not per_sequence:
        return 0, ""
    need = per_sequence * max_sequences
    if need >= budget:
        raise ValueError(f"The linear layers' state of `--max-batch {max_sequences}` sequences needs {need} bytes "
                         f"({per_sequence} per sequence), the whole KV budget of {budget} bytes or more; lower "
                         f"`--max-batch` or raise `--kv-cache-bytes`")  # fmt: skip
    return need, (f"{max_sequences} slots x {per_sequence} bytes ({len(config.state_layers)} linear layers: conv "
                  f"state and fp32 recurrent state)")  # fmt: skip
