"""Grouped-query self-attention over packed tokens and a per-slot KV cache.

Design: q, k and v come from one fused projection `wqkv` (one matmul over every token of
the batch), and q and k are rotated together as one `[T, H + Hkv, D]` view. A step then
attends in two groups:
- decode rows (one token per sequence, any position) all at once: each row's cache view
  `[Hkv, len, D]` is gathered (or taken as a view when the slots are consecutive), padded
  to the longest row and masked by length, and the query heads of one KV group are folded
  into the query-length axis (`[Nd, Hkv, G, D]`) so a single SDPA call covers GQA without
  repeating K/V;
- prefill chunks one by one with a causal SDPA over the chunk's own K/V (or over the
  cached prefix plus the chunk when it continues a sequence).
Trade-off: padding decode rows to the longest one wastes work when lengths differ a lot;
on CPU that is cheaper than a loop of SDPA calls per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.config import ModelConfig
from workers.kv_cache import ForwardBatch, KVCache
from workers.rope import apply_rotary


@dataclass(frozen=True, eq=False)
class StepContext:
    """Per-step tensors shared by every layer (built once in `Transformer.step`)."""

    batch: ForwardBatch
    kv: KVCache
    cos: torch.Tensor  # [T, 1, D/2]
    sin: torch.Tensor  # [T, 1, D/2]
    decode_mask: torch.Tensor | None  # [Nd, 1, 1, Lmax] bool, None when every row has length Lmax
    prefill_masks: tuple[torch.Tensor | None, ...]  # per prefill: [n, start+n] bool, None if start == 0


def build_step_context(batch: ForwardBatch, kv: KVCache, cos, sin) -> StepContext:
    decode_mask = None
    if batch.decode_rows.numel() and bool((batch.decode_lens != batch.decode_max_len).any()):
        cols = torch.arange(batch.decode_max_len, device=batch.decode_lens.device)  # [Lmax]
        decode_mask = (cols[None, :] < batch.decode_lens[:, None])[:, None, None, :]  # [Nd, 1, 1, Lmax]
    masks = []
    for span in batch.prefills:
        if span.start_pos == 0:
            masks.append(None)
            continue
        rows = torch.arange(span.num_tokens, device=cos.device)[:, None] + span.start_pos  # [n, 1]
        cols = torch.arange(span.start_pos + span.num_tokens, device=cos.device)[None, :]  # [1, start+n]
        masks.append(cols <= rows)  # [n, start+n]
    return StepContext(batch, kv, cos, sin, decode_mask, tuple(masks))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)

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
        batch = ctx.batch
        q, k, v = self._qkv(x, ctx.cos, ctx.sin)  # [T, Hq|Hkv, D]
        kc = ctx.kv.k[self.layer_index]  # [slots, Hkv, S, D]
        vc = ctx.kv.v[self.layer_index]  # [slots, Hkv, S, D]
        # 1. Write every token's K/V at (slot, position) in one indexed store.
        kc[batch.slots, :, batch.positions] = k.to(kc.dtype)  # [T, Hkv, D] scattered
        vc[batch.slots, :, batch.positions] = v.to(vc.dtype)
        if not batch.prefills:
            return self.wo(self._decode(q, kc, vc, ctx).flatten(-2))  # [T, H]
        out = torch.empty_like(q)  # [T, Hq, D]
        # 2. Decode rows together, 3. prefills one by one.
        if batch.decode_rows_start is not None:  # consecutive rows: slices, no gather/scatter
            rows = slice(batch.decode_rows_start, batch.decode_rows_start + batch.decode_rows.numel())
            out[rows] = self._decode(q[rows], kc, vc, ctx)
        elif batch.decode_rows.numel():
            out[batch.decode_rows] = self._decode(q[batch.decode_rows], kc, vc, ctx)
        for span, mask in zip(batch.prefills, ctx.prefill_masks, strict=True):
            rows = slice(span.row_start, span.row_start + span.num_tokens)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if mask is None:
                kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                vp = v[rows].transpose(0, 1).unsqueeze(0)
            else:
                end = span.start_pos + span.num_tokens
                kp = kc[span.slot, :, :end].unsqueeze(0).to(q.dtype)  # [1, Hkv, start+n, D]
                vp = vc[span.slot, :, :end].unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )  # [1, Hq, n, D]
            out[rows] = o[0].transpose(0, 1)
        return self.wo(out.flatten(-2))  # [T, H]

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q [Nd, Hq, D] of one-token chunks -> attention output [Nd, Hq, D]."""
        batch = ctx.batch
        n, length = q.shape[0], batch.decode_max_len
        if batch.decode_slot_start is not None:
            s0 = batch.decode_slot_start
            kd, vd = kc[s0 : s0 + n, :, :length], vc[s0 : s0 + n, :, :length]  # views [Nd, Hkv, L, D]
        else:
            kd = kc[:, :, :length].index_select(0, batch.decode_slots)  # [Nd, Hkv, L, D]
            vd = vc[:, :, :length].index_select(0, batch.decode_slots)
        group = self.n_heads // self.n_kv_heads
        qd = q.view(n, self.n_kv_heads, group, self.head_dim)  # [Nd, Hkv, G, D]: GQA group as query axis
        o = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=ctx.decode_mask)
        return o.reshape(n, self.n_heads, self.head_dim)  # [Nd, Hq, D]
