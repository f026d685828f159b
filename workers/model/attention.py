"""Grouped-query self-attention over packed tokens and the paged KV cache.

Design: q, k and v come from one fused projection `wqkv` (one matmul over every token of
the batch), and q and k are rotated together as one `[T, H + Hkv, D]` view. A step writes
every token's K/V into its cache slot (one indexed store per layer), then attends in two
groups:
- decode rows (one token per sequence, any position) all at once through `PagedAttention`,
  the kernel-swappable layer: on the CPU the rows' blocks are gathered and one masked SDPA
  covers them (GQA folded into the query axis); on GPUs a Triton kernel reads the blocks in
  place through the block table;
- prefill chunks one by one with a causal SDPA over the chunk's own K/V, or, when the chunk
  continues a sequence (a chunked prompt, a cached prefix, a recomputed preemption), over
  its gathered cached positions plus the chunk.
Trade-off: padding decode rows to the longest one wastes work when lengths differ a lot;
on CPU that is cheaper than a loop of SDPA calls per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kv.batch import ForwardBatch, gather_kv
from workers.kv.pool import KVPool
from workers.model.config import ModelConfig
from workers.model.deterministic import attend_paged
from workers.model.layers import PagedAttention
from workers.model.rope import apply_rotary


@dataclass(frozen=True, eq=False)
class StepContext:
    """Per-step tensors shared by every layer (built once in `Transformer.step`)."""

    batch: ForwardBatch
    kv: KVPool
    cos: torch.Tensor  # [T, 1, D/2]
    sin: torch.Tensor  # [T, 1, D/2]
    prefill_masks: tuple[torch.Tensor | None, ...]  # per prefill: [n, start+n] bool, None if start == 0


def build_step_context(batch: ForwardBatch, kv: KVPool, cos, sin) -> StepContext:
    masks = []
    for span in batch.prefills:
        if span.start_pos == 0:
            masks.append(None)
            continue
        rows = torch.arange(span.num_tokens, device=cos.device)[:, None] + span.start_pos  # [n, 1]
        cols = torch.arange(span.start_pos + span.num_tokens, device=cos.device)[None, :]  # [1, start+n]
        masks.append(cols <= rows)  # [n, start+n]
    return StepContext(batch, kv, cos, sin, tuple(masks))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.paged = PagedAttention()
        self.kv_split: int | None = None  # deterministic mode: every row attends in fixed splits

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> q [..., T, Hq, D], k, v [..., T, Hkv, D] with rope applied to q and k."""
        qkv = self.wqkv(x).unflatten(-1, (self.n_heads + 2 * self.n_kv_heads, self.head_dim))
        qk = apply_rotary(qkv[..., : self.n_heads + self.n_kv_heads, :], cos, sin)  # [..., T, Hq+Hkv, D]
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=-2)
        v = qkv[..., self.n_heads + self.n_kv_heads :, :]  # [..., T, Hkv, D]
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Full causal attention without a cache: x [B, S, H] -> [B, S, H]."""
        q, k, v = self._qkv(x, cos, sin)  # [B, S, Hq|Hkv, D]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, Hq|Hkv, S, D]
            is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads,
        )  # [B, Hq, S, D]
        return self.wo(out.transpose(1, 2).flatten(-2))  # [B, S, H]

    def step(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Packed attention for one step: x [T, H] -> [T, H]; writes this layer's K/V."""
        batch, decode = ctx.batch, ctx.batch.decode
        q, k, v = self._qkv(x, ctx.cos, ctx.sin)  # [T, Hq|Hkv, D]
        kv = ctx.kv.layer(self.layer_index)  # [2, Hkv, NB, B, D]
        # 1. Write every token's K/V at its slot (block * B + offset) in one indexed store.
        slots = kv.view(2, self.n_kv_heads, -1, self.head_dim)  # [2, Hkv, NB*B, D]
        slots[:, :, batch.slot_mapping] = torch.stack((k, v)).transpose(1, 2).to(kv.dtype)  # [2, Hkv, T, D]
        if self.kv_split is not None:  # deterministic mode: one fixed-split path for every row
            return self.wo(attend_paged(q, kv, batch, self.kv_split).flatten(-2))
        if not batch.prefills:
            return self.wo(self.paged(q, kv, decode).flatten(-2))  # [T, H]
        out = torch.empty_like(q)  # [T, Hq, D]
        # 2. Decode rows together, 3. prefills one by one.
        if decode is not None and decode.rows_start is not None:  # consecutive rows: slices
            rows = slice(decode.rows_start, decode.rows_start + decode.num)
            out[rows] = self.paged(q[rows], kv, decode)
        elif decode is not None:
            out[decode.rows] = self.paged(q[decode.rows], kv, decode)
        for span, mask in zip(batch.prefills, ctx.prefill_masks, strict=True):
            rows = slice(span.row_start, span.row_start + span.num_tokens)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if span.blocks is None:
                kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                vp = v[rows].transpose(0, 1).unsqueeze(0)
            else:
                kp, vp = gather_kv(kv, span.blocks, span.start_pos + span.num_tokens)  # [1, Hkv, start+n, D]
            o = F.scaled_dot_product_attention(
                qp, kp.to(q.dtype), vp.to(q.dtype), attn_mask=mask, is_causal=mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )  # [1, Hq, n, D]
            out[rows] = o[0].transpose(0, 1)
        return self.wo(out.flatten(-2))  # [T, H]
