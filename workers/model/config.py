"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

Design: every architecture we serve (Llama 2/3/3.x, Mistral, Qwen2) is the same decoder
with a few switches (grouped-query attention, qkv bias, tied embeddings, llama3 rope
scaling), so one `ModelConfig` describes them all and `from_hf_config` is the only place
that knows Hugging Face's spellings (`rope_scaling` in transformers 4, `rope_parameters`
in transformers 5). Trade-off: features outside that family (sliding-window attention,
MoE, alibi) are refused with a named error instead of being half supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # config.json `architectures[0]` or `model_type` -> our architecture name
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class ConfigError(ValueError):
    """A config.json this server cannot run; the message names the field and what is allowed."""


def _architecture(hf: dict[str, Any]) -> str:
    names = list(hf.get("architectures") or []) + [hf.get("model_type")]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    shown = (hf.get("architectures") or [None])[0] or hf.get("model_type")
    supported = sorted(k for k in SUPPORTED_ARCHITECTURES if k[0].isupper())
    raise ConfigError(f"Unsupported architecture `{shown}`. Supported: {', '.join(supported)}")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either transformers 4 or 5 spellings."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"Unsupported rope type `{rope_type}`. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **merged}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder. `head_dim` defaults to hidden/heads."""

    architecture: str = "llama"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads (set in __post_init__)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None  # what the checkpoint was saved in (config.json), informative

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        if self.architecture not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"Unsupported architecture `{self.architecture}`. Supported: llama, mistral, qwen2")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"`head_dim` must be even for rotary embeddings, got `{self.head_dim}`")

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
        layer = qkv + self.q_size * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h

    # ---- Hugging Face round trip ------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict (transformers 4 or 5 spellings)."""
        arch = _architecture(hf)
        if arch == "mistral" and hf.get("sliding_window") not in (None, 0) and hf.get(
            "max_position_embeddings", 0
        ) > int(hf["sliding_window"]):
            # Windowed attention is not implemented; only the prefix up to the window is exact.
            max_pos = int(hf["sliding_window"])
        else:
            max_pos = int(hf.get("max_position_embeddings", 2048))
        if hf.get("use_sliding_window"):
            raise ConfigError("`use_sliding_window: true` is not supported. Supported: false")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"Unsupported `hidden_act` `{hf['hidden_act']}`. Supported: silu")
        if hf.get("mlp_bias"):
            raise ConfigError("`mlp_bias: true` is not supported. Supported: false")
        theta, scaling = _rope(hf)
        heads = int(hf["num_attention_heads"])
        # Qwen2 always has qkv bias (its config has no `attention_bias` key).
        bias = bool(hf.get("attention_bias", arch == "qwen2"))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_eos_ids(hf.get("eos_token_id")),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that both this loader and transformers 5 read."""
        cls_name = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        out: dict[str, Any] = {
            "architectures": [cls_name[self.architecture]],
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
            out["mlp_bias"] = False
        if self.architecture == "mistral":
            out["sliding_window"] = None
        if self.architecture == "qwen2":
            out["use_sliding_window"] = False
        return out
