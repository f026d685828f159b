"""Each layer's own shape where a family's layers differ (Gemma 4): head dim and KV heads per
layer type, whose KV a layer reads, its projections' and MLP's widths, and their parameters.

Design: `ModelConfig` takes these as a mixin, so the model, the weight map and the KV cache ask
one place per layer instead of reading `head_dim` and `num_key_value_heads` as the whole
model's. The switches: full-attention layers' own head dim and KV heads (`global_head_dim`,
`global_kv_heads`; 0: the model's), `attention_k_eq_v` (full layers whose keys are their values),
`kv_shared_layers` (the last layers read the cache of the last earlier layer of their type, held
once and counted once in the KV budget) and `double_wide_mlp`. Trade-off: a model whose layers
are all alike walks the same per-layer questions, a few integer reads per layer at build time."""

from __future__ import annotations

from typing import Any

from workers.model.families.base import FULL, SLIDING, ConfigError


class LayerShapes:
    """Per-layer shapes over `ModelConfig`'s fields (a mixin: it has no fields of its own)."""

    # ---- attention shapes ------------------------------------------------------------
    def layer_head_dim(self, index: int) -> int:
        return self.global_head_dim if self.global_head_dim and self.layer_type(index) == FULL else self.head_dim

    def layer_kv_heads(self, index: int) -> int:
        if self.global_kv_heads and self.layer_type(index) == FULL:
            return self.global_kv_heads
        return self.num_key_value_heads

    def layer_k_eq_v(self, index: int) -> bool:
        """The layer's values are its key projection (Gemma 4's full layers under `attention_k_eq_v`)."""
        return self.attention_k_eq_v and self.layer_type(index) != SLIDING

    def kv_source(self, index: int) -> int | None:
        """The earlier layer whose KV cache layer `index` reads (KV sharing); None: its own."""
        first = self.num_hidden_layers - self.kv_shared_layers
        if index < first:
            return None
        kind = self.layer_type(index)
        return max(j for j in range(first) if self.layer_type(j) == kind)

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Each layer's cache: its own index, or the producer's it shares (the KV pool's map)."""
        return tuple(i if (s := self.kv_source(i)) is None else s for i in range(self.num_hidden_layers))

    @property
    def layer_kv_shapes(self) -> tuple[tuple[int, int] | None, ...]:
        """Each layer's cache (KV heads, head dim); None for a layer reading another's cache, or a
        linear-attention layer's (a recurrent state instead: workers/kv/state.py)."""
        linear = set(self.state_layers)
        return tuple(None if self.kv_source(i) is not None or i in linear
                     else (self.layer_kv_heads(i), self.layer_head_dim(i)) for i in range(self.num_hidden_layers))

    def layer_qkv_sizes(self, index: int) -> tuple[int, int, int]:
        """Widths of the layer's fused projection's q, k and v parts (0: not projected)."""
        d = self.layer_head_dim(index)
        q = self.num_attention_heads * d
        if self.kv_source(index) is not None:
            return q, 0, 0
        kv = self.layer_kv_heads(index) * d
        return q, kv, 0 if self.layer_k_eq_v(index) else kv

    def layer_intermediate_size(self, index: int) -> int:
        """The dense MLP's width: twice `intermediate_size` on a KV-sharing layer under `double_wide_mlp`."""
        wide = self.double_wide_mlp and self.kv_source(index) is not None
        return self.intermediate_size * (2 if wide else 1)

    @property
    def has_layer_shapes(self) -> bool:
        """Whether some layer differs from the others in shape (the per-layer parameter count)."""
        return bool(self.global_head_dim or self.global_kv_heads or self.attention_k_eq_v or self.kv_shared_layers
                    or self.per_layer_input_size or self.moe_block or self.layer_scalar)

    def _check_shapes(self) -> None:
        for i in range(self.num_hidden_layers):
            d, hkv = self.layer_head_dim(i), self.layer_kv_heads(i)
            if d % 2 or hkv < 1 or self.num_attention_heads % hkv:
                raise ConfigError(f"Layer {i} ({self.layer_type(i)}) has head dim `{d}` and `{hkv}` KV heads; it "
                                  f"needs an even head dim and KV heads dividing {self.num_attention_heads}")
        if not 0 <= self.kv_shared_layers < self.num_hidden_layers:
            raise ConfigError(f"`kv_shared_layers` `{self.kv_shared_layers}` must be 0..{self.num_hidden_layers - 1}")
        first = self.num_hidden_layers - self.kv_shared_layers
        missing = {self.layer_type(i) for i in range(first, self.num_hidden_layers)} - {
            self.layer_type(j) for j in range(first)}
        if missing:
            raise ConfigError(f"KV-sharing layers of type `{sorted(missing)[0]}` have no earlier layer of that type")
        if self.per_layer_input_size and self.per_layer_vocab_size < 1:
            raise ConfigError(f"Per-layer inputs need `per_layer_vocab_size` >= 1, got `{self.per_layer_vocab_size}`")

    # ---- parameters ------------------------------------------------------------------
    def _shaped_parameters(self) -> int:
        """Parameter count, layer by layer (tied embeddings counted once; `layer_scalar` is a buffer)."""
        h, n, p = self.hidden_size, self.num_hidden_layers, self.per_layer_input_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if p:
            total += self.per_layer_vocab_size * n * p + n * p * h + p
        norms = {"pre": 2, "post": 2, "sandwich": 4}[self.norm_placement] * h
        for i in range(n):
            q, k, v = self.layer_qkv_sizes(i)
            d = self.layer_head_dim(i)
            total += h * (q + k + v) + (q + k + v) * self.attention_bias + q * h + h * self.o_bias + norms
            total += {None: 0, "head": d * (2 if k else 1), "projection": q + k}[self.qk_norm]
            total += 3 * h * self.layer_intermediate_size(i) + 2 * h * p + h * bool(p)
            if self.moe_block:  # router (projection, scale, per-expert scale), experts and three norms
                total += self.num_experts * (h + 1) + h + self.num_experts * 3 * h * self.moe_intermediate_size + 3 * h
        return total

    def shape_features(self) -> dict[str, Any]:
        """The per-layer switches for `ModelConfig.features` (`/capability`, `plan`)."""
        out: dict[str, Any] = {}
        if self.global_head_dim or self.global_kv_heads:
            full = next((i for i in range(self.num_hidden_layers) if self.layer_type(i) == FULL), 0)
            out["global_head_dim"] = self.layer_head_dim(full)
            out["global_kv_heads"] = self.layer_kv_heads(full)
        if self.attention_k_eq_v:
            out["attention_k_eq_v"] = True
        if self.kv_shared_layers:
            out["kv_shared_layers"] = self.kv_shared_layers
        if self.per_layer_input_size:
            out["per_layer_inputs"] = self.per_layer_input_size
        if self.double_wide_mlp and self.kv_shared_layers:
            out["double_wide_mlp"] = True
        if self.moe_block:
            out["moe_block"] = "experts beside the dense MLP"
        return out
