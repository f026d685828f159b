"""KV cache and the batch description that one `Transformer.step` runs.

Design: the cache is two dense tensors `k, v: [L, slots, Hkv, S, D]`, contiguous per slot
(one slot = one sequence, positions 0..S-1). A sequence's K/V for a layer is the plain
view `k[l, slot, :, :len]`, so attention needs no block tables and a run of consecutive
decode slots is read without a copy. Trade-off: every slot reserves `max_seq_len`
positions up front (no paging), which wastes memory on short sequences but keeps the
step code small and fast on CPU; `for_budget` sizes slots x length to a byte budget.

`ForwardBatch.build` does all index bookkeeping once on the host (token -> slot,
positions, which rows decode, where each prefill starts), so the model's step is only
tensor work plus one small loop over prefill chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.config import ModelConfig

logger = logging.getLogger(__name__)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Per-layer keys and values for `num_slots` sequences of up to `max_seq_len` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"KV cache needs `num_slots` >= 1 and `max_seq_len` >= 1, got `{num_slots}` and `{max_seq_len}`"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        # Zero-filled: positions past a sequence's length are masked, but must stay finite.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, Hkv, S, D]

    @classmethod
    def for_config(
        cls, config: ModelConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype, device="cpu"
    ) -> KVCache:
        return cls(
            config.num_hidden_layers, num_slots, max_seq_len, config.num_key_value_heads,
            config.head_dim, dtype, device,
        )

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes one token position occupies across all layers (K and V)."""
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * _dtype_size(dtype)

    @classmethod
    def for_budget(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        budget_bytes: int,
        max_slots: int,
        max_seq_len: int,
    ) -> KVCache:
        """The largest cache within `budget_bytes`: full `max_seq_len` (capped by the model's
        context), and as many slots as fit, at most `max_slots`. Raises if not even one fits."""
        seq_len = min(max_seq_len, config.max_position_embeddings)
        per_slot = cls.bytes_per_token(config, dtype) * seq_len
        slots = min(max_slots, budget_bytes // per_slot)
        if slots < 1:
            raise ValueError(
                f"KV cache budget `{budget_bytes}` bytes is below one sequence of {seq_len} tokens "
                f"({per_slot} bytes); raise the budget or lower `max_seq_len`"
            )
        logger.info("KV cache: %s slots x %s tokens, %s bytes", slots, seq_len, slots * per_slot)
        return cls.for_config(config, int(slots), seq_len, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass(frozen=True)
class SeqChunk:
    """A run of one sequence's tokens in a step: a prompt (or part of one) or one decode token."""

    slot: int
    start_pos: int  # position of the chunk's first token; 0 for a fresh prompt
    num_tokens: int  # prompt length on prefill, 1 on decode


@dataclass(frozen=True)
class PrefillSpan:
    """Where a multi-token chunk lies in the packed batch (host ints, no tensor sync)."""

    row_start: int  # first row of the chunk in the packed [T] tokens
    num_tokens: int
    slot: int
    start_pos: int


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """Packed tokens of several chunks. Chunks with one token are attended together as decode
    rows (any position), chunks with more tokens are prefills (attended one by one)."""

    input_ids: torch.Tensor  # [T] int64, chunks' tokens concatenated in chunk order
    positions: torch.Tensor  # [T] int64
    chunks: tuple[SeqChunk, ...]
    logits_index: torch.Tensor  # [N] int64, row of each chunk's last token
    slots: torch.Tensor  # [T] int64, cache slot of each token
    decode_rows: torch.Tensor  # [Nd] int64, rows of the one-token chunks
    decode_slots: torch.Tensor  # [Nd] int64
    decode_lens: torch.Tensor  # [Nd] int64, attended length (position + 1)
    decode_max_len: int  # max(decode_lens), 0 without decodes
    decode_slot_start: int | None  # first slot when decode slots are consecutive ascending
    decode_rows_start: int | None  # first row when decode rows are consecutive
    prefills: tuple[PrefillSpan, ...]
    max_pos: int  # largest position in the batch

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls, items: Sequence[tuple[SeqChunk, Sequence[int]]], device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        """Pack `(chunk, token ids)` pairs; `len(ids)` must equal `chunk.num_tokens`."""
        if not items:
            raise ValueError("A ForwardBatch needs at least one chunk, got `0`")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        dec_rows: list[int] = []
        dec_slots: list[int] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        seen: set[int] = set()
        # 1. Lay the chunks out one after the other and record each chunk's role.
        for chunk, tokens in items:
            if chunk.num_tokens < 1 or len(tokens) != chunk.num_tokens:
                raise ValueError(
                    f"Chunk for slot `{chunk.slot}` declares `num_tokens={chunk.num_tokens}` "
                    f"but carries `{len(tokens)}` tokens; they must be equal and >= 1"
                )
            if chunk.start_pos < 0 or chunk.slot < 0:
                raise ValueError(f"Chunk `{chunk}` has a negative slot or start_pos")
            if chunk.slot in seen:
                raise ValueError(f"Slot `{chunk.slot}` appears twice in one batch; one chunk per sequence")
            seen.add(chunk.slot)
            row = len(ids)
            ids.extend(int(t) for t in tokens)
            positions.extend(range(chunk.start_pos, chunk.start_pos + chunk.num_tokens))
            slots.extend([chunk.slot] * chunk.num_tokens)
            logits_index.append(row + chunk.num_tokens - 1)
            if chunk.num_tokens == 1:
                dec_rows.append(row)
                dec_slots.append(chunk.slot)
                dec_lens.append(chunk.start_pos + 1)
            else:
                prefills.append(PrefillSpan(row, chunk.num_tokens, chunk.slot, chunk.start_pos))
        # 2. Detect consecutive decode slots/rows: attention then reads views, not gathers.
        n_dec = len(dec_rows)
        slot_start = dec_slots[0] if n_dec and dec_slots == list(range(dec_slots[0], dec_slots[0] + n_dec)) else None
        rows_start = dec_rows[0] if n_dec and dec_rows == list(range(dec_rows[0], dec_rows[0] + n_dec)) else None

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(
            input_ids=t(ids),
            positions=t(positions),
            chunks=tuple(chunk for chunk, _ in items),
            logits_index=t(logits_index),
            slots=t(slots),
            decode_rows=t(dec_rows),
            decode_slots=t(dec_slots),
            decode_lens=t(dec_lens),
            decode_max_len=max(dec_lens, default=0),
            decode_slot_start=slot_start,
            decode_rows_start=rows_start,
            prefills=tuple(prefills),
            max_pos=max(positions),
        )
