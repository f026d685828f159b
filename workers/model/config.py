"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Design: every family we serve is the Llama decoder with switches, so one `ModelConfig`
describes them all: the sizes, the rotary (global, and the sliding layers' own where a family
has one), and what a family switches on (norm placement and style, q/k norms, activation,
attention scale, soft-caps, sliding layers, NoPE layers, multipliers, biases).
`from_hf_config` is the only place that reads Hugging Face's spellings: the fields every
family shares here (transformers 4 and 5 alike), the rest through the family's own `read`
(workers/model/families/). Each layer's attention then comes from `layer(i)`: its window and
its rotary. Trade-off: a family whose architecture is more than switches on this decoder
(mixtures of experts, linear attention) is refused by name until it has its own layers,
instead of being half supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from workers.model.families.base import FULL, LAYER_TYPES, SLIDING, FamilyConfigError
from workers.model.families.registry import FAMILIES, family, family_of
from workers.model.rope import RopeConfigError, RopeSpec

NORM_PLACEMENTS = ("pre", "post", "sandwich")  # before each sub-layer; after it (OLMo 2); both (Gemma)
NORM_STYLES = ("llama", "fp32", "gemma")  # w * x.to(dtype); (w * x).to(dtype); (x * (1 + w)).to(dtype)
QK_NORMS = (None, "head", "projection")
ACTIVATIONS = ("silu", "gelu_tanh")
ROUTERS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")


class ConfigError(ValueError):
    """A config.json this server cannot run; the message names the field and what is allowed."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer's attention: the positions it sees and how it rotates them."""

    index: int
    sliding_window: int | None  # attends to the last `sliding_window` positions; None: all of them
    rope: RopeSpec | None  # None: a NoPE layer (no rotary)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"`{name}` `{value}` is not supported. Supported: {', '.join(map(str, allowed))}")


@dataclass(frozen=True)
class ModelConfig:
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
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ConfigError(f"`layer_types` must list {self.num_hidden_layers} of {', '.join(LAYER_TYPES)}, "
                              f"got `{list(self.layer_types)}`")
        if self.num_experts:
            _choice("router", self.router, ROUTERS)
            _choice("expert_activation", self.expert_activation, EXPERT_ACTIVATIONS)
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ConfigError(f"`num_experts_per_tok` must be 1..{self.num_experts} and `moe_intermediate_size` "
                                  f">= 1, got `{self.num_experts_per_tok}` and `{self.moe_intermediate_size}`")
            if any(not 0 <= i < self.num_hidden_layers for i in self.sparse_layers):
                raise ConfigError(f"`sparse_layers` `{list(self.sparse_layers)}` must be layers of "
                                  f"0..{self.num_hidden_layers - 1}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError("Sliding layers need a `sliding_window` (a positive integer), got `None`")
        try:
            self._specs()
        except RopeConfigError as e:
            raise ConfigError(str(e)) from e

    # ---- derived sizes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) * self.attention_bias
        norms = {"pre": 2, "post": 2, "sandwich": 4}[self.norm_placement] * h
        qk = {None: 0, "head": 2 * self.head_dim, "projection": self.q_size + self.kv_size}[self.qk_norm]
        layer = (qkv + self.q_size * h + h * self.o_bias + norms + qk + self.num_attention_heads * self.attention_sinks)
        dense = 3 * h * i + (2 * i + h) * self.mlp_bias
        sparse = len(self.sparse_layers)
        return (v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h
                + (self.num_hidden_layers - sparse) * dense + sparse * self._moe_layer(self.num_experts))

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
        return router + experts * (3 * h * i + (2 * i + h) * self.expert_bias)

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
        def spec(theta, scaling):
            return RopeSpec.create({**(scaling or {}), "rope_theta": theta,
                                    "partial_rotary_factor": self.partial_rotary_factor},
                                   self.head_dim, self.max_position_embeddings)

        full = spec(self.rope_theta, self.rope_scaling)
        local = full if self.local_rope_theta is None else spec(self.local_rope_theta, self.local_rope_scaling)
        return full, local

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    def layer(self, index: int) -> LayerSpec:
        """Layer `index`'s window and rotary."""
        full, local = self._rope_specs
        sliding = self.layer_type(index) == SLIDING
        rope = None if index in self.nope_layers else (local if sliding else full)
        return LayerSpec(index, self.sliding_window if sliding else None, rope)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention): the KV cache's groups."""
        return tuple(self.layer(i).sliding_window for i in range(self.num_hidden_layers))

    @property
    def features(self) -> dict[str, Any]:
        """What this architecture switches on beyond the Llama baseline (`/capability`, `plan`)."""
        full, _ = self._rope_specs
        out: dict[str, Any] = {"rope": full.rope_type}
        if full.rotary_dim != self.head_dim:
            out["partial_rotary"] = f"{full.rotary_dim}/{self.head_dim}"
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
        if self.num_experts:
            out["experts"] = f"{self.num_experts_per_tok} of {self.num_experts}"
            out["sparse_layers"] = len(self.sparse_layers)
            out["parameters"] = self.num_parameters
            out["active_parameters"] = self.active_parameters
        return out

    # ---- Hugging Face round trip ------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 spellings)."""
        try:
            fam = family_of(hf)
            heads = int(hf["num_attention_heads"])
            shared = dict(
                architecture=fam.name,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=_eos_ids(hf.get("eos_token_id")),
                torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            )
            return cls(**{**shared, **fam.read(hf)})
        except (FamilyConfigError, RopeConfigError) as e:
            raise ConfigError(str(e)) from e

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that both this loader and transformers 5 read (the Llama baseline's
        families: the ones checkpoints are exported as)."""
        fam = family(self.architecture)
        if not fam.hf_class:
            raise ConfigError(f"Export of `{self.architecture}` is not supported. Supported: llama, mistral, qwen2")
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        out: dict[str, Any] = {
            "architectures": [fam.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(rope) if self.rope_scaling else None,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                None if not self.eos_token_id
                else self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
            ),
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if self.architecture == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.architecture == "qwen2":
            out["use_sliding_window"] = bool(self.sliding_window)
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = list(self.layer_types) or None
        return out
