"""The decoder of every family in the registry, in plain torch.

Design (gpt-fast style): `Transformer.from_config` builds the module on the meta device and the
loader assigns real tensors with `load_state_dict(..., assign=True)`, so weights are never
allocated twice. Projections are fused (`wqkv`, `w_gate_up`) and stay `nn.Linear`, so fp8
quantisation can swap them; a family's options are plain switches (norm placement and style,
activation, embedding scale, residual multiplier, final soft-cap, logits divisor), each layer's
attention taking its own window and rotary (`ModelConfig.layer`). Two entry points share the
weights: `model(input_ids)`, the full causal forward without a cache (parity tests, training),
and `model.step(batch, kv)`, one engine step over packed chunks that writes K/V into the paged
cache and projects only the rows the batch asks for to fp32 logits. Trade-off: one decoder with
switches for every family, so a family that is more than switches needs its own layers here."""

from __future__ import annotations

import torch
from torch import nn

from workers.kv.batch import ForwardBatch
from workers.kv.pool import KVPool
from workers.model.attention import Attention, build_step_context, causal_mask, make_norm
from workers.model.config import ModelConfig
from workers.model.layers import FloatRMSNorm, GeluTanhAndMul, SiluAndMul, embedding
from workers.model.linear_attention import GatedDeltaNet
from workers.model.moe import MoEFeedForward
from workers.model.moe_block import MoEBlock
from workers.model.per_layer_inputs import PerLayerGate, PerLayerInputs
from workers.model.rope import RotaryTables


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        i = intermediate or config.intermediate_size
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * i, bias=config.mlp_bias)
        self.act = SiluAndMul() if config.activation == "silu" else GeluTanhAndMul()
        self.w_down = nn.Linear(i, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.act(self.w_gate_up(x)))  # [..., H] -> [..., 2I] -> [..., I] -> [..., H]


class TransformerBlock(nn.Module):
    """One layer: attention then feed-forward, each normed where the family puts its norms:
    `pre` (Llama), `post` (OLMo 2: the output normed before the residual add) or `sandwich`
    (Gemma: both). Gemma 4 adds experts beside the dense MLP (`moe_block`), its per-layer input
    after the feed-forward (`per_layer`) and a learned scale of the layer's output (`layer_scalar`)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        h, placement = config.hidden_size, config.norm_placement
        pre, post = placement in ("pre", "sandwich"), placement in ("post", "sandwich")
        self.attention_norm = make_norm(config, h) if pre else None
        # a linear layer (Qwen3.5, Qwen3-Next) mixes tokens with Gated DeltaNet instead, through the same entry points
        linear = layer_index in config.state_layers
        self.attention = GatedDeltaNet(config, layer_index) if linear else Attention(config, config.layer(layer_index))
        self.post_attention_norm = make_norm(config, h) if post else None
        self.ffn_norm = make_norm(config, h) if pre else None
        sparse = layer_index in config.sparse_layers
        self.feed_forward = (MoEFeedForward(config) if sparse and not config.moe_block
                             else FeedForward(config, config.layer_intermediate_size(layer_index)))
        self.moe_block = MoEBlock(config) if sparse and config.moe_block else None
        self.post_ffn_norm = make_norm(config, h) if post else None
        self.residual_scale = config.residual_scale
        self.per_layer = PerLayerGate(config) if config.per_layer_input_size else None
        # each layer's learned output scale (Gemma 4): a buffer, as transformers keeps it
        self.register_buffer("layer_scalar", torch.ones(1) if config.layer_scalar else None)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post: nn.Module | None) -> torch.Tensor:
        if post is not None:
            out = post(out)
        return x + (out if self.residual_scale == 1.0 else out * self.residual_scale)

    def _feed_forward(self, h: torch.Tensor, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        f = self.feed_forward(self.ffn_norm(h) if self.ffn_norm else h)
        if self.moe_block is not None:  # the experts read the residual itself
            f = self.moe_block(f, h)
        out = self._residual(h, f, self.post_ffn_norm)
        if self.per_layer is not None:
            out = self.per_layer(out, per_layer_input)
        return out if self.layer_scalar is None else out * self.layer_scalar

    def forward(self, x: torch.Tensor, rope, masks, per_layer_input=None, shared=None) -> torch.Tensor:
        a = self.attention(self.attention_norm(x) if self.attention_norm else x, rope, masks[self.attention.window],
                           shared)
        h = self._residual(x, a, self.post_attention_norm)  # [B, S, H]
        return self._feed_forward(h, per_layer_input)

    def step(self, x: torch.Tensor, ctx, per_layer_input=None) -> torch.Tensor:
        a = self.attention.step(self.attention_norm(x) if self.attention_norm else x, ctx)  # [T, H]
        h = self._residual(x, a, self.post_attention_norm)
        return self._feed_forward(h, per_layer_input)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.per_layer_inputs = PerLayerInputs(config) if config.per_layer_input_size else None
        self.norm = make_norm(config, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryTables()
        self.stage: tuple[int, int] | None = None  # a pipeline stage's layers [start, end) (`keep_stage`)
        specs = [config.layer(i) for i in range(config.num_hidden_layers)]
        self.rope_specs = tuple(dict.fromkeys(s.rope for s in specs if s.rope is not None))  # distinct, in order
        self.windows = tuple(dict.fromkeys(s.sliding_window for s in specs))
        # the shortest length past which a token's rotation changes (dynamic, LongRoPE), if any
        self.rope_threshold = min((t for s in self.rope_specs if (t := s.threshold) is not None), default=None)
        self.tie_weights()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
        """Build on the meta device (no memory) in `dtype`. Load weights with `load_weights` (or
        `load_state_dict(sd, assign=True)` then `tie_weights()`): they bring their device."""
        with torch.device("meta"):
            model = cls(config)
        model.to(dtype=dtype)
        return model

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        std: float = 0.02,
    ) -> Transformer:
        """A materialised model with random weights (training from scratch, tests)."""
        model = cls.from_config(config, dtype)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights(seed, std)
        return model

    def _ties(self) -> bool:
        """Whether the head reads the embedding's weight: a stage before the last has no head, and a
        packed GGUF head holds the blocks it shares with the embedding itself (workers/gguf/embedding.py)."""
        return (self.config.tie_word_embeddings and hasattr(self, "output")
                and isinstance(getattr(self, "tok_embeddings", None), nn.Embedding))

    def tie_weights(self) -> None:
        if self._ties():
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Normal(0, std) for matrices, zeros for biases, a unit scale for norms (GPT-2 style)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        offsets = {f"{n}.weight": m.offset for n, m in self.named_modules() if isinstance(m, FloatRMSNorm)}
        for name, b in self.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(1.0)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "router_scale", "per_expert_scale")):
                p.fill_(1.0 - offsets.get(name, 0.0))  # Gemma's (1 + w) norms: w = 0
            elif name.endswith("bias") or name.rsplit(".", 1)[-1].startswith("b_"):  # b_: experts' biases
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def load_weights(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Assign `state_dict` (our names, already in the right dtype/device) and re-tie."""
        sd = dict(state_dict)
        if self._ties():
            sd.setdefault("output.weight", sd.get("tok_embeddings.weight"))
        self.load_state_dict(sd, strict=strict, assign=True)
        self.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype  # a pipeline stage may hold no embedding

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def rope_policy(self) -> tuple[int, str] | None:
        """(threshold, rope type) of a rotary whose result depends on the sequence's length
        (dynamic, longrope), for the scheduler; None when none does."""
        for spec in self.rope_specs:
            if spec.threshold is not None:
                return spec.threshold, spec.rope_type
        return None

    def new_kv_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                    state_slots: int = 0) -> KVPool:
        """`state_slots`: sequences at once, for a model with linear layers (workers/kv/state.py)."""
        return KVPool.for_config(self.config, num_blocks, block_size, dtype or self.dtype, self.device,
                                 state_slots=state_slots)

    # ---- the pieces both passes share -------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        scale = self.config.embedding_scale
        if scale == 1.0:
            return x
        if self.config.embedding_scale_rounded:  # the scale as a value of the weights' dtype (Gemma)
            return x * torch.tensor(scale, dtype=x.dtype, device=x.device)
        return x * scale

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(x))
        c = self.config
        if c.logits_divisor != 1.0:
            logits = logits / c.logits_divisor
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    # ---- forward passes --------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward: input_ids [B, S] -> logits [B, S, V] (model dtype)."""
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        lengths = torch.full_like(positions, seq_len)  # one forward over the whole sequence
        rope = {spec: self.rope.lookup(spec, positions, seq_len - 1, self.dtype, lengths) for spec in self.rope_specs}
        masks = {w: None if w is None or w >= seq_len else causal_mask(positions, seq_len, w) for w in self.windows}
        x = self._embed(input_ids)  # [B, S, H]
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, x)  # [B, S, L, P]
        shared = {} if self.config.kv_shared_layers else None  # producers' K, V for the layers sharing them
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, masks, None if per_layer is None else per_layer[..., i, :], shared)
        return self._logits(x)  # [B, S, V]

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, kv: KVPool, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step: logits [N, V] fp32 at the rows of `batch.logits_index` (a pipeline
        stage's step: see `_stage_step`)."""
        if batch.max_block >= kv.num_blocks or batch.block_size != kv.block_size:
            raise ValueError(
                f"Batch reads block `{batch.max_block}` of size {batch.block_size}; the KV pool has "
                f"{kv.num_blocks} blocks of size {kv.block_size}"
            )
        if len(batch.groups) + 1 != len(kv.groups) or any(
                g.max_block >= pool.num_blocks for g, pool in zip(batch.groups, kv.groups[1:], strict=True)):
            raise ValueError(f"Batch has tables of `{len(batch.groups) + 1}` KV groups (blocks up to "
                             f"`{[g.max_block for g in batch.groups]}`); the pool has {kv.group_shapes} "
                             f"(build the batch with `windows=kv.windows`)")
        rope = {spec: self.rope.lookup(spec, batch.positions, batch.max_pos, self.dtype, batch.rope_lens)
                for spec in self.rope_specs}  # [T, 1, R/2] each
        ctx = build_step_context(batch, kv, rope, bool(self.config.kv_shared_layers))
        if self.stage is not None:  # a pipeline stage: its layers only (workers/pipeline/)
            return self._stage_step(batch, ctx, hidden)
        x = self._embed(batch.input_ids)  # [T, H]
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(batch.input_ids, x)  # [T, L, P]
        for i, layer in enumerate(self.layers):
            x = layer.step(x, ctx, None if per_layer is None else per_layer[:, i])
        return self._step_logits(x, batch)

    def _step_logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self._projected(x, batch).float()  # [N, V]

    def _projected(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The logits [N, V] at `batch.logits_index`, in the dtype the head computes them in."""
        if x.shape[0] != batch.logits_index.shape[0]:  # equal only when every row is projected, in order
            x = x.index_select(0, batch.logits_index)  # [N, H]
        return self._logits(x)

    # ---- a pipeline stage ---------------------------------------------------------------
    def keep_stage(self, start: int, end: int) -> None:
        """Keep layers `start <= i < end` only (on the meta device, before loading): the first stage
        keeps the embedding, the last the final norm and head (and the embedding it is tied to).
        The other layers become empty modules, so the kept ones keep their checkpoint names."""
        n, c = self.config.num_hidden_layers, self.config
        unsplit = [why for on, why in ((c.per_layer_input_size, "per-layer inputs"),
                                       (c.kv_shared_layers, "layers that read another layer's KV")) if on]
        if unsplit:
            raise ValueError(f"A model with {' and '.join(unsplit)} cannot be split into pipeline stages yet "
                             f"({c.architecture}). Accepted: models whose layers each keep their own KV cache")
        if not 0 <= start < end <= n:
            raise ValueError(f"Stage layers `{start}:{end}` are not a non-empty range of the model's {n} layers")
        self.stage = (start, end)
        for i in range(n):
            if not start <= i < end:
                self.layers[i] = nn.Module()  # no parameters, no name in the state dict
        first, last = start == 0, end == n
        if not first and not (last and self.config.tie_word_embeddings):
            del self.tok_embeddings
        if not last:
            del self.norm, self.output

    def _stage_step(self, batch: ForwardBatch, ctx, hidden: torch.Tensor | None) -> torch.Tensor:
        """The stage's layers over `hidden` [T, H] (the first stage embeds `batch.input_ids`):
        hidden [T, H] for the next stage, or the last stage's logits [N, V] as the head computes
        them: the first stage makes them fp32 as `step` does (exact), half the bytes on the wire."""
        start, end = self.stage
        x = self._embed(batch.input_ids) if start == 0 else hidden  # [T, H]
        for i in range(start, end):
            x = self.layers[i].step(x, ctx)
        return self._projected(x, batch) if end == self.config.num_hidden_layers else x
