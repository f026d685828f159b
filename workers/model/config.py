"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Design: every family we serve is the Llama decoder with switches, so one `ModelConfig`
describes them all: the sizes, the rotary (global, and the sliding layers' own where a family
has one), and what a family switches on (norm placement and style, q/k norms, activation,
attention scale, soft-caps, sliding layers, NoPE layers, multipliers, biases, experts, linear
attention). `from_hf_config` is the only way in from Hugging Face's spellings
(workers/model/hf_config.py, then the family's own `read` in workers/model/families/). Each
layer's attention comes from `layer(i)`: its window and its rotary. Trade-off: a family whose
architecture is more than switches on this decoder needs layers of its own (as the experts and
the linear attention have) and is refused by name until then, instead of being half supported."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from workers.model.families.base import FULL, LAYER_TYPES, LINEAR, SLIDING, ConfigError, FamilyConfigError
from workers.model.families.registry import FAMILIES, family
from workers.model.hf_config import hf_dict, hf_fields
from workers.model.layer_shapes import LayerShapes
from workers.model.rope import RopeConfigError, RopeSpec

NORM_PLACEMENTS = ("pre", "post", "sandwich")  # before each sub-layer; after it (OLMo 2); both (Gemma)
NORM_STYLES = ("llama", "fp32", "gemma", "gemma4")  # w * x.to(dtype); (w * x).to(dtype); (x * (1 + w)).to(dtype);
# gemma4: (w * x * pow(mean + eps, -0.5)).to(dtype) (workers/model/layers.py `PowRMSNorm`)
QK_NORMS = (None, "head", "projection")
ACTIVATIONS = ("silu", "gelu_tanh")
ROUTERS = ("softmax_topk", "topk_softmax", "gemma4")
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's attention: the positions it sees and how it rotates them."""

    index: int
    sliding_window: int | None  # attends to the last `sliding_window` positions; None: all of them
    rope: RopeSpec | None  # None: a NoPE layer (no rotary)
    head_dim: int = 0  # its own head dim and KV heads (workers/model/layer_shapes.py); 0: the model's
    kv_heads: int = 0
    kv_source: int | None = None  # the earlier layer whose KV cache it reads (KV sharing); None: its own
    k_eq_v: bool = False  # its values are its key projection (no value projection)


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"`{name}` `{value}` is not supported. Supported: {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class ModelConfig(LayerShapes):
    """Hyper-parameters of a decoder of the registry. `head_dim` defaults to hidden/heads."""

    architecture: str = "llama"  # the family (workers/model/families/registry.py)
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads (set in __post_init__)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    # rotary: the global layers', the sliding layers' own (None: the same), NoPE layers
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    partial_rotary_factor: float = 1.0
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    nope_layers: tuple[int, ...] = ()
    # projections
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v
    o_bias: bool = False  # a bias on the attention output projection
    mlp_bias: bool = False
    # what the family switches on
    norm_placement: str = "pre"
    norm_style: str = "llama"
    qk_norm: str | None = None
    activation: str = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" | "sliding_attention"; (): all full
    embedding_scale: float = 1.0  # embeddings x this (Gemma: sqrt(hidden); Granite: its multiplier)
    embedding_scale_rounded: bool = False  # the scale is first rounded to the weights' dtype (Gemma)
    residual_scale: float = 1.0  # each sub-layer's output x this before the residual add (Granite)
    logits_divisor: float = 1.0  # logits / this (Granite's `logits_scaling`)
    attention_sinks: bool = False  # a learned logit per head joins each softmax (gpt-oss)
    # mixture of experts (workers/model/moe.py); num_experts 0: every layer dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()  # the layers with experts; the others dense (intermediate_size)
    router: str = "softmax_topk"  # softmax then top-k (Qwen3-MoE, Mixtral) | top-k then softmax (gpt-oss)
    norm_topk_prob: bool = False  # the top-k probabilities renormalized to sum to 1
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"  # silu | swiglu_oai (gpt-oss's clamped SwiGLU)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones, sigmoid-gated (Qwen3-Next)
    # hybrids (Qwen3.5, Qwen3-Next): layers typed "linear_attention" are Gated DeltaNet layers
    # (workers/model/linear_attention.py) with a per-sequence state instead of KV (workers/kv/state.py)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4  # the short causal convolution's width
    attn_output_gate: bool = False  # q_proj also gives each head a sigmoid gate on its output
    # per-layer shapes, shared KV and per-layer inputs (Gemma 4; workers/model/layer_shapes.py)
    global_head_dim: int = 0  # full-attention layers' head dim; 0: head_dim
    global_kv_heads: int = 0  # full-attention layers' KV heads; 0: num_key_value_heads
    attention_k_eq_v: bool = False  # full-attention layers' values are their key projection
    v_norm: bool = False  # a scale-less RMSNorm over each value head
    kv_shared_layers: int = 0  # the last this many layers read the KV of the last earlier layer of their type
    double_wide_mlp: bool = False  # those layers' MLP is twice `intermediate_size` wide
    per_layer_input_size: int = 0  # per-layer input embeddings this wide (workers/model/per_layer_inputs.py)
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False  # each layer's output times its learned scalar
    moe_block: bool = False  # experts beside the dense MLP, summed (workers/model/moe_block.py)
    # tokens and provenance
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None  # what the checkpoint was saved in (config.json), informative

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        for name in ("layer_types", "nope_layers", "sparse_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _choice("architecture", self.architecture, tuple(sorted(FAMILIES)))
        _choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _choice("norm_style", self.norm_style, NORM_STYLES)
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        _choice("activation", self.activation, ACTIVATIONS)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"`head_dim` must be even for rotary embeddings, got `{self.head_dim}`")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or any(t not in (*LAYER_TYPES, LINEAR) for t in self.layer_types)):
            raise ConfigError(f"`layer_types` must list {self.num_hidden_layers} of {', '.join(LAYER_TYPES)} "
                              f"(or {LINEAR}), got `{list(self.layer_types)}`")
        if self.state_layers:
            self._check_linear()
        if self.num_experts:
            _choice("router", self.router, ROUTERS)
            _choice("expert_activation", self.expert_activation, EXPERT_ACTIVATIONS)
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ConfigError(f"`num_experts_per_tok` must be 1..{self.num_experts} and `moe_intermediate_size` "
                                  f">= 1, got `{self.num_experts_per_tok}` and `{self.moe_intermediate_size}`")
            if any(not 0 <= i < self.num_hidden_layers for i in self.sparse_layers):
                raise ConfigError(f"`sparse_layers` `{list(self.sparse_layers)}` must be layers of "
                                  f"0..{self.num_hidden_layers - 1}")
        if self.intermediate_size < 1 and len(self.sparse_layers) < self.num_hidden_layers:
            raise ConfigError(f"`intermediate_size` must be >= 1 for the dense layers' feed-forward, got "
                              f"`{self.intermediate_size}`")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError("Sliding layers need a `sliding_window` (a positive integer), got `None`")
        if self.has_layer_shapes:
            self._check_shapes()
        try:
            self._specs()
        except RopeConfigError as e:
            raise ConfigError(str(e)) from e

    def _check_linear(self) -> None:
        sizes = {k: getattr(self, k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                               "linear_value_head_dim", "linear_conv_kernel")}
        if min(sizes.values()) < 1 or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"Linear attention needs positive sizes and value heads a multiple of key heads, got "
                              f"`{sizes}`")
        if len(self.state_layers) == self.num_hidden_layers:
            raise ConfigError(f"`layer_types` has no attention layer (all {LINEAR}); at least one is needed")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The linear-attention layers: a recurrent state per sequence, no KV (workers/kv/state.py)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's convolution: q, k and v."""
        return 2 * self.linear_key_size + self.linear_value_size

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        if self.has_layer_shapes:
            return self._shaped_parameters()
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.q_size * (2 if self.attn_output_gate else 1)  # with each head's output gate
        qkv = h * (q + 2 * self.kv_size) + (q + 2 * self.kv_size) * self.attention_bias
        norms = {"pre": 2, "post": 2, "sandwich": 4}[self.norm_placement] * h
        qk = {None: 0, "head": 2 * self.head_dim, "projection": self.q_size + self.kv_size}[self.qk_norm]
        layer = (qkv + self.q_size * h + h * self.o_bias + qk + self.num_attention_heads * self.attention_sinks)
        linear = len(self.state_layers)
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        sparse = len(self.sparse_layers)
        return (v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * norms + h
                + (self.num_hidden_layers - linear) * layer + linear * self._linear_layer()
                + (self.num_hidden_layers - sparse) * dense + sparse * self._moe_layer(self.num_experts))

    def _linear_layer(self) -> int:
        """One Gated DeltaNet layer's parameters: projections, convolution, decay, norm, output."""
        h, hv, vs = self.hidden_size, self.linear_num_value_heads, self.linear_value_size
        return (h * (self.linear_conv_dim + vs + 2 * hv) + self.linear_conv_dim * self.linear_conv_kernel + 2 * hv
                + self.linear_value_head_dim + vs * h)

    @property
    def active_parameters(self) -> int:
        """Parameters one token computes with: its `num_experts_per_tok` experts, not all of them."""
        if not self.num_experts:
            return self.num_parameters
        sparse = len(self.sparse_layers)
        return self.num_parameters - sparse * (self._moe_layer(self.num_experts)
                                               - self._moe_layer(self.num_experts_per_tok))

    def _moe_layer(self, experts: int) -> int:
        """One sparse layer's parameters with `experts` experts (and its router)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        router = self.num_experts * (h + self.router_bias)
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return router + shared + experts * (3 * h * i + (2 * i + h) * self.expert_bias)

    @property
    def context_length(self) -> int:
        """The longest sequence served: `max_position_embeddings`, times the factor of a dynamic
        (NTK) rotary, whose point is to run past it."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    # ---- each layer's attention --------------------------------------------------------
    @cached_property
    def _rope_specs(self) -> tuple[RopeSpec, RopeSpec]:
        return self._specs()

    def _specs(self) -> tuple[RopeSpec, RopeSpec]:
        def spec(theta, scaling, head_dim):  # a factor inside `scaling` is its type's own (proportional)
            return RopeSpec.create({"partial_rotary_factor": self.partial_rotary_factor, **(scaling or {}),
                                    "rope_theta": theta}, head_dim, self.max_position_embeddings)

        full = spec(self.rope_theta, self.rope_scaling, self.global_head_dim or self.head_dim)
        local = (full if self.local_rope_theta is None and not self.global_head_dim
                 else spec(self.local_rope_theta or self.rope_theta, self.local_rope_scaling, self.head_dim))
        return full, local

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    def layer(self, index: int) -> LayerSpec:
        """Layer `index`'s window and rotary."""
        full, local = self._rope_specs
        sliding = self.layer_type(index) == SLIDING
        rope = None if index in self.nope_layers else (local if sliding else full)
        return LayerSpec(index, self.sliding_window if sliding else None, rope, self.layer_head_dim(index),
                         self.layer_kv_heads(index), self.kv_source(index), self.layer_k_eq_v(index))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention): the KV cache's groups."""
        return tuple(self.layer(i).sliding_window for i in range(self.num_hidden_layers))

    @property
    def features(self) -> dict[str, Any]:
        """What this architecture switches on beyond the Llama baseline (`/capability`, `plan`)."""
        full, _ = self._rope_specs
        out: dict[str, Any] = {"rope": full.rope_type}
        if full.rotated_dims != full.rotary_dim or full.rotary_dim != (self.global_head_dim or self.head_dim):
            out["partial_rotary"] = f"{full.rotated_dims}/{self.global_head_dim or self.head_dim}"
        if self.sliding_window and SLIDING in self.layer_types:
            out["sliding_window"] = self.sliding_window
            out["sliding_layers"] = sum(t == SLIDING for t in self.layer_types)
        for name in ("attn_softcap", "final_softcap", "qk_norm"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.nope_layers:
            out["nope_layers"] = len(self.nope_layers)
        if self.norm_placement != "pre":
            out["norm_placement"] = self.norm_placement
        if self.activation != "silu":
            out["activation"] = self.activation
        if self.attention_sinks:
            out["attention_sinks"] = True
        if self.state_layers:
            out["linear_layers"] = len(self.state_layers)
            out["linear_attention"] = "gated_deltanet"
        if self.attn_output_gate:
            out["attn_output_gate"] = True
        out.update(self.shape_features())
        if self.num_experts:
            out["experts"] = f"{self.num_experts_per_tok} of {self.num_experts}"
            if self.shared_expert_intermediate_size:
                out["shared_expert"] = self.shared_expert_intermediate_size
            out["sparse_layers"] = len(self.sparse_layers)
            out["parameters"] = self.num_parameters
            out["active_parameters"] = self.active_parameters
        return out

    # ---- Hugging Face round trip (workers/model/hf_config.py) ---------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 spellings)."""
        try:
            return cls(**hf_fields(hf))
        except (FamilyConfigError, RopeConfigError) as e:
            raise ConfigError(str(e)) from e

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that both this loader and transformers 5 read (the Llama baseline's
        families: the ones checkpoints are exported as)."""
        if not family(self.architecture).hf_class:
            raise ConfigError(f"Export of `{self.architecture}` is not supported. Supported: llama, mistral, qwen2")
        return hf_dict({f.name: getattr(self, f.name) for f in fields(self)})
