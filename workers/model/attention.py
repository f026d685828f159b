"""Grouped-query self-attention over packed tokens and the paged KV cache, with each layer's options.

Design: q, k and v come from one fused projection `wqkv`, then a layer's family options apply in
transformers' order: q/k norms (per head or over the whole projection), the rotary of the layer's
kind (none on a NoPE layer), the layer's scale, soft-cap and sliding window. A step writes every
token's K/V into its cache slot, then attends in two groups: decode rows all at once through
`PagedAttention`, the kernel-swappable layer (the CPU's C++ kernel or a masked SDPA over the
gathered rows, a Triton kernel reading the blocks in place on GPUs), and prefill chunks one by
one with a causal SDPA over the chunk, plus its gathered cached positions when it continues a
sequence. Trade-off: padding decode rows to the longest one wastes work when lengths differ a
lot, which on a CPU is cheaper than a loop of SDPA calls; a soft-capped layer cannot use SDPA's
fused kernel and pays for explicit score matrices."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.kv.batch import ForwardBatch, gather_kv
from workers.kv.mirror import explicit_attention
from workers.kv.pool import KVPool
from workers.model.config import LayerSpec, ModelConfig
from workers.model.deterministic import attend_paged
from workers.model.layers import FloatRMSNorm, PagedAttention, PowRMSNorm, RMSNorm
from workers.model.rope import RopeSpec, apply_rotary


def make_norm(config: ModelConfig, width: int) -> nn.Module:
    """The family's RMSNorm over `width` (Llama's is kernel-swappable; OLMo's and Gemma's are not)."""
    if config.norm_style == "llama":
        return RMSNorm(width, config.rms_norm_eps)
    if config.norm_style == "gemma4":
        return PowRMSNorm(width, config.rms_norm_eps)
    return FloatRMSNorm(width, config.rms_norm_eps, offset=1.0 if config.norm_style == "gemma" else 0.0)


def causal_mask(rows: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[n, length] bool: query at position `rows[i]` sees keys `<= rows[i]` (and `> rows[i] - window`)."""
    cols = torch.arange(length, device=rows.device)[None, :]
    mask = cols <= rows[:, None]
    if window is not None:
        mask &= cols > rows[:, None] - window
    return mask


@dataclass(frozen=True, eq=False)
class StepContext:
    """Per-step tensors shared by every layer (built once in `Transformer.step`)."""

    batch: ForwardBatch
    kv: KVPool
    rope: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]]  # spec -> cos, sin [T, 1, R/2]
    prefill_masks: tuple[tuple[torch.Tensor | None, ...], ...]  # per KV group, per prefill: mask or None
    shared: dict[int, tuple] | None = None  # KV sharing: a producer layer's K, V [T, Hkv, D] of this step


def build_step_context(batch: ForwardBatch, kv: KVPool, rope, share_kv: bool = False) -> StepContext:
    """`rope`: each spec's cos/sin; `share_kv`: some layers read others' KV (their K, V pass through
    `shared`). Each KV group's prefill masks: its window over the positions its spans read (from
    `span.base`)."""
    masks = []
    for g, group in enumerate(kv.groups):
        window, per_span = group.window, []
        for span in batch.group(g).prefills:
            end = span.start_pos + span.num_tokens
            if span.start_pos == 0 and (window is None or span.num_tokens <= window):
                per_span.append(None)  # plain causal: SDPA's own
                continue
            rows = torch.arange(span.start_pos - span.base, end - span.base, device=batch.positions.device)
            per_span.append(causal_mask(rows, end - span.base, window))  # [n, end - base]
        masks.append(tuple(per_span))
    return StepContext(batch, kv, rope, tuple(masks), {} if share_kv else None)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: LayerSpec) -> None:
        super().__init__()
        self.layer_index = layer.index
        self.n_heads = config.num_attention_heads
        # the layer's own shape (Gemma 4's global layers: workers/model/layer_shapes.py)
        self.n_kv_heads = layer.kv_heads or config.num_key_value_heads
        self.head_dim = d = layer.head_dim or config.head_dim
        self.shares_kv = layer.kv_source is not None  # it projects no K/V and reads an earlier layer's
        self.kv_layer = layer.index if layer.kv_source is None else layer.kv_source
        self.k_eq_v = layer.k_eq_v  # its values are its key projection
        self.rope = layer.rope
        self.window = layer.sliding_window
        self.scale = config.attention_scale if config.attention_scale is not None else d**-0.5
        self.softcap = config.attn_softcap
        self.qk_norm = config.qk_norm
        self.output_gate = config.attn_output_gate  # q_proj gives each head [query | gate] (Qwen3.5, Qwen3-Next)
        q_size, kv_size = self.n_heads * d, self.n_kv_heads * d
        kv_width = 0 if self.shares_kv else kv_size * (1 if self.k_eq_v else 2)
        self.wqkv = nn.Linear(config.hidden_size, q_size * (2 if self.output_gate else 1) + kv_width,
                              bias=config.attention_bias)
        self.wo = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        if self.qk_norm is not None:
            head = self.qk_norm == "head"
            self.q_norm = make_norm(config, d if head else q_size)
            if not self.shares_kv:
                self.k_norm = make_norm(config, d if head else kv_size)
        # Gemma 4: a scale-less norm over each value head
        self.v_norm = PowRMSNorm(d, config.rms_norm_eps, with_scale=False) if config.v_norm else None
        self.paged = PagedAttention()
        if config.attention_sinks:  # one learned logit per query head, in every softmax (gpt-oss)
            self.paged.sinks = nn.Parameter(torch.empty(config.num_attention_heads))
        # the decode layer's options (its default scale left to SDPA, whose fused path it keeps)
        self.paged.sliding_window, self.paged.softcap = self.window, self.softcap
        self.paged.scale = None if config.attention_scale is None else self.scale
        self.kv_split: int | None = None  # deterministic mode: every row attends in fixed splits

    def _qkv(self, x: torch.Tensor, rope: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]]):
        """x [..., T, H] -> q [..., T, Hq, D], k, v [..., T, Hkv, D], normed and rotated as the layer asks,
        and the output gate [..., T, Hq, D] (None without one)."""
        qkv = self.wqkv(x)
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if self.shares_kv or self.k_eq_v or self.v_norm is not None:
            return self._qkv_gemma4(qkv, rope)
        if self.output_gate:  # each head's query then its gate, interleaved by head
            qg, kv = qkv.split((2 * hq * d, 2 * hkv * d), dim=-1)
            q, gate = qg.unflatten(-1, (hq, 2 * d)).chunk(2, dim=-1)  # [..., T, Hq, D] each
            k, v = kv.unflatten(-1, (2 * hkv, d)).chunk(2, dim=-2)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rope is not None:
                cos, sin = rope[self.rope]
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            return q, k, v, gate
        if self.qk_norm == "projection":  # over the whole projection, before the heads are split
            q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
            q, k = self.q_norm(q).unflatten(-1, (hq, d)), self.k_norm(k).unflatten(-1, (hkv, d))
            v = v.unflatten(-1, (hkv, d))
        else:
            heads = qkv.unflatten(-1, (hq + 2 * hkv, d))  # [..., T, Hq+2Hkv, D]
            if self.qk_norm is None and self.rope is not None:  # q and k rotated together, as one view
                cos, sin = rope[self.rope]
                qk = apply_rotary(heads[..., : hq + hkv, :], cos, sin)  # [..., T, Hq+Hkv, D]
                q, k = qk.split((hq, hkv), dim=-2)
                return q, k, heads[..., hq + hkv :, :], None
            q, k, v = heads.split((hq, hkv, hkv), dim=-2)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = rope[self.rope]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v, None

    def _qkv_gemma4(self, qkv: torch.Tensor, rope):
        """Gemma 4's layers: only q where the layer shares KV, the key projection doubling as the
        values where `k_eq_v`; q and k normed then rotated, the values normed, never rotated."""
        hq, hkv = self.n_heads, self.n_kv_heads
        heads = qkv.unflatten(-1, (-1, self.head_dim))  # [..., T, Hq (+ Hkv (+ Hkv)), D]
        q, k, v = heads[..., :hq, :], None, None
        if not self.shares_kv:
            k = heads[..., hq : hq + hkv, :]
            v = k if self.k_eq_v else heads[..., hq + hkv :, :]
            k = self.k_norm(k) if self.qk_norm == "head" else k
            v = v if self.v_norm is None else self.v_norm(v)
        q = self.q_norm(q) if self.qk_norm == "head" else q
        if self.rope is not None:
            cos, sin = rope[self.rope]
            q, k = apply_rotary(q, cos, sin), None if k is None else apply_rotary(k, cos, sin)
        return q, k, v, None

    def _shared_kv(self, k, v, shared: dict | None):
        """KV sharing: a producer leaves its K, V for this step's consumers; a consumer takes its producer's."""
        if self.shares_kv:
            return shared[self.kv_layer]
        if shared is not None:
            shared[self.layer_index] = (k, v)
        return k, v

    def _out(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The output projection of o [..., Hq, D], each head gated by sigmoid(gate) where the layer has one."""
        return self.wo((o if gate is None else o * torch.sigmoid(gate)).flatten(-2))

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Softmax attention of q [B, Hq, S, D] over k, v [B, Hkv, L, D] (`mask` [S, L] or None)."""
        sinks = getattr(self.paged, "sinks", None)
        if self.softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)
        g = self.n_heads // self.n_kv_heads
        if mask is None and causal:
            mask = causal_mask(torch.arange(q.shape[-2], device=q.device), k.shape[-2], None)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return explicit_attention(q, k, v, mask, self.scale, self.softcap,
                                  None if sinks is None else sinks.view(1, -1, 1, 1))  # [1, Hq, 1, 1]

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None = None,
                shared: dict | None = None) -> torch.Tensor:
        """Full causal attention without a cache: x [B, S, H] -> [B, S, H]; `mask` [S, S] for a
        sliding layer (None: causal); `shared` the producers' K, V where layers share them."""
        q, k, v, gate = self._qkv(x, rope)  # [B, S, Hq|Hkv, D]
        k, v = self._shared_kv(k, v, shared)
        out = self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, True)  # [B, Hq, S, D]
        return self._out(out.transpose(1, 2), gate)  # [B, S, H]

    def step(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Packed attention for one step: x [T, H] -> [T, H]; writes this layer's K/V."""
        group = ctx.kv.group_of[self.layer_index]
        batch = ctx.batch.group(group)  # this layer's KV group: its slots and tables
        decode = batch.decode
        q, k, v, gate = self._qkv(x, ctx.rope)  # [T, Hq|Hkv, D]
        kv = ctx.kv.layer(self.layer_index)  # [2, Hkv, NB, B, D] (a KV-sharing layer: its producer's)
        # 1. Write every token's K/V at its slot (block * B + offset) in one indexed store; a layer
        #    sharing KV writes nothing and takes its producer's K, V for the chunks it attends whole.
        if not self.shares_kv:
            ctx.kv.write(self.layer_index, batch.slot_mapping, k, v)
        k, v = self._shared_kv(k, v, ctx.shared)
        if self.kv_split is not None:  # deterministic mode: one fixed-split path for every row
            o = attend_paged(q, kv, batch, self.kv_split, self.window, self.scale, self.softcap,
                             getattr(self.paged, "sinks", None))
            return self._out(o, gate)
        if not batch.prefills:
            return self._out(self.paged(q, kv, decode), gate)  # [T, H]
        out = torch.empty_like(q)  # [T, Hq, D]
        # 2. Decode rows together, 3. prefills one by one.
        if decode is not None and decode.rows_start is not None:  # consecutive rows: slices
            rows = slice(decode.rows_start, decode.rows_start + decode.num)
            out[rows] = self.paged(q[rows], kv, decode)
        elif decode is not None:
            out[decode.rows] = self.paged(q[decode.rows], kv, decode)
        for span, mask in zip(batch.prefills, ctx.prefill_masks[group], strict=True):
            rows = slice(span.row_start, span.row_start + span.num_tokens)
            qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if span.blocks is None:
                kp = k[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                vp = v[rows].transpose(0, 1).unsqueeze(0)
            else:  # the cached positions from `base` (a window's first visible block) and the chunk
                kp, vp = gather_kv(kv, span.blocks, span.start_pos + span.num_tokens - span.base)  # [1, Hkv, L, D]
            o = self._attend(qp, kp.to(q.dtype), vp.to(q.dtype), mask, True)  # [1, Hq, n, D]
            out[rows] = o[0].transpose(0, 1)
        return self._out(out, gate)  # [T, H]
