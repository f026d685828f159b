"""What a family is, and what the families share: the Llama baseline's tensor names and the
readers of the config.json fields several families spell alike.

A `Family` is a frozen value: its names, its tensor map and `read(hf) -> dict`, the
`ModelConfig` fields its `config.json` sets beyond the shared ones (sizes, rotary, tokens),
which `workers/model/config.py` reads for every family. `read` refuses, with a
`FamilyConfigError` that names the field and what is accepted, whatever the family's
architecture has that this server does not compute (never a silent approximation). The
tensor map is `{HF name with {i} for the layer: (our name, part)}`: `part` is the index of a
fused tensor's piece (q, k, v in `wqkv`; gate, up in `w_gate_up`), None for a whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# the layer types (LINEAR: a Gated DeltaNet layer, workers/model/linear_attention.py) and activations
# are the contract's tables, which the router checks a checkpoint against too
from workers.contract.checkpoint_check import (
    FULL,
    HF_ACTIVATIONS,
    LAYER_TYPES,
    LINEAR,  # noqa: F401  (the families and config.py read it here)
    SLIDING,
)

WeightMap = Mapping[str, tuple[str, int | None]]


class ConfigError(ValueError):
    """A config.json this server cannot run; the message names the field and what is allowed."""


class FamilyConfigError(ValueError):
    """A family's config.json asks for something this server cannot compute; names the field."""


@dataclass(frozen=True)
class Family:
    name: str  # ours: `ModelConfig.architecture`
    architectures: tuple[str, ...]  # config.json `architectures[0]`
    model_types: tuple[str, ...]  # config.json `model_type`
    weights: WeightMap
    read: Callable[[dict[str, Any]], dict[str, Any]] = field(compare=False)
    hf_class: str = ""  # for export (`ModelConfig.to_hf_config`); families we only load leave it empty
    # tensor layouts that depend on the config: `layouts(config) -> {name: (HF -> ours, ours -> HF,
    # our shape -> HF shape)}`, used as `part` names in `weights` (workers/model/weights.py `TRANSFORMS`)
    layouts: Callable[[Any], dict[str, tuple]] | None = field(default=None, compare=False)
    # tensors a checkpoint carries that this server does not compute (a vision tower, a multi-token
    # prediction head): regexes over HF names, skipped at load with one log line each
    skipped: tuple[str, ...] = ()


# The Llama baseline: pre-norm decoder, fused q/k/v and gate/up projections.
LLAMA_WEIGHTS: dict[str, tuple[str, int | None]] = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", None),
    "model.norm.weight": ("norm.weight", None),
    "lm_head.weight": ("output.weight", None),
    "model.layers.{i}.input_layernorm.weight": ("layers.{i}.attention_norm.weight", None),
    "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.attention.wqkv.weight", 0),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.attention.wqkv.weight", 1),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.attention.wqkv.weight", 2),
    "model.layers.{i}.self_attn.q_proj.bias": ("layers.{i}.attention.wqkv.bias", 0),
    "model.layers.{i}.self_attn.k_proj.bias": ("layers.{i}.attention.wqkv.bias", 1),
    "model.layers.{i}.self_attn.v_proj.bias": ("layers.{i}.attention.wqkv.bias", 2),
    "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.attention.wo.weight", None),
    "model.layers.{i}.self_attn.o_proj.bias": ("layers.{i}.attention.wo.bias", None),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.ffn_norm.weight", None),
    "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.feed_forward.w_gate_up.weight", 0),
    "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.feed_forward.w_gate_up.weight", 1),
    "model.layers.{i}.mlp.gate_proj.bias": ("layers.{i}.feed_forward.w_gate_up.bias", 0),
    "model.layers.{i}.mlp.up_proj.bias": ("layers.{i}.feed_forward.w_gate_up.bias", 1),
    "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.feed_forward.w_down.weight", None),
    "model.layers.{i}.mlp.down_proj.bias": ("layers.{i}.feed_forward.w_down.bias", None),
}
# Per-head (Qwen3, Gemma 3) or whole-projection (OLMo 2) q/k norms.
QK_NORM_WEIGHTS: dict[str, tuple[str, int | None]] = {
    "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.attention.q_norm.weight", None),
    "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.attention.k_norm.weight", None),
}


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text model: its `text_config`, with the top level's `architectures`
    and embedding tying (which transformers takes from there); a text checkpoint as it is. Its
    weights sit under `model.language_model.` (workers/model/weights.py `text_name`)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    top = {k: hf[k] for k in ("architectures", "tie_word_embeddings") if k in hf}
    fallback = {k: hf[k] for k in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id") if k in hf}
    return {**fallback, **text, **top}


def with_weights(base: Mapping[str, tuple[str, int | None]], add: Mapping | None = None,
                 drop: tuple[str, ...] = (), rename: Mapping[str, tuple[str, int | None]] | None = None) -> dict:
    """A family's map from the baseline's: names added, dropped or mapped to other targets."""
    out = {k: v for k, v in base.items() if k not in drop}
    out.update(rename or {})
    out.update(add or {})
    return out


def refuse(hf: dict[str, Any], name: str, allowed: tuple, what: str | None = None) -> None:
    """`FamilyConfigError` when `hf[name]` (if present) is not one of `allowed`."""
    if name in hf and hf[name] not in allowed:
        shown = ", ".join("null" if a is None else str(a).lower() for a in allowed)
        raise FamilyConfigError(f"`{name}: {hf[name]}` is not supported{what or ''}. Supported: {shown}")


def activation(hf: dict[str, Any], *keys: str, default: str = "silu") -> str:
    """Our activation name for the first of `keys` present (`hidden_act`, `hidden_activation`)."""
    names = HF_ACTIVATIONS
    raw = next((hf[k] for k in keys if hf.get(k) is not None), default)
    if raw not in names:
        raise FamilyConfigError(f"Unsupported `{keys[0]}` `{raw}`. Supported: {', '.join(sorted(names))}")
    return names[raw]


def layer_types(hf: dict[str, Any], sliding_window: int | None, default: Callable[[int], str] | None = None) -> tuple:
    """Each layer's attention type: config.json's `layer_types` (transformers 5), else what the
    family derives from its other fields (`default(i)`), else every layer full. Without a
    window no layer slides."""
    n = int(hf["num_hidden_layers"])
    given = hf.get("layer_types")
    if given is not None:
        if len(given) != n or any(t not in LAYER_TYPES for t in given):
            raise FamilyConfigError(f"`layer_types` must list {n} of {', '.join(LAYER_TYPES)}, got `{given}`")
        types = tuple(given)
    else:
        types = tuple(default(i) if default else FULL for i in range(n))
    if sliding_window is None:
        return tuple(FULL for _ in types)
    return types


def window(hf: dict[str, Any], enabled: bool = True) -> int | None:
    """`sliding_window` when set (and the family's switch for it is on), else None."""
    w = hf.get("sliding_window")
    if not enabled or w in (None, 0):
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise FamilyConfigError(f"`sliding_window` must be a positive integer, got `{w}`")
    return int(w)


def qwen_layer_types(hf: dict[str, Any], w: int | None) -> tuple:
    """Qwen2 / Qwen3: layers from `max_window_layers` on slide (when `use_sliding_window`)."""
    first = int(hf.get("max_window_layers") or 0)
    return layer_types(hf, w, lambda i: SLIDING if i >= first else FULL)


_ROPE_KEYS = ("rope_theta", "partial_rotary_factor", "rope_type", "type")
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


def _standard_rope(hf: dict[str, Any], params: dict | None, theta: float) -> tuple[float, float, dict | None]:
    """(theta, partial rotary factor, scaling dict or None) of one rope parameter set."""
    p = dict(params or {})
    theta = float(p.get("rope_theta", theta))
    partial = float(p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        return theta, partial, None
    scaling = {"rope_type": rope_type, **{k: v for k, v in p.items() if k not in _ROPE_KEYS}}
    if rope_type in _NEEDS_ORIGINAL:
        # Phi-3 keeps the pretraining length at the top level, and it wins (as in transformers)
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or hf.get("max_position_embeddings", 2048))
    return theta, partial, scaling


def rope_fields(hf: dict[str, Any], default_theta: float = 10000.0, local_theta_key: str | None = None,
                local_default_theta: float | None = None) -> dict[str, Any]:
    """The `ModelConfig` rotary fields from transformers 5's `rope_parameters` (flat, or one set
    per layer type) or transformers 4's `rope_theta` / `rope_scaling` / `partial_rotary_factor`
    (and a family's own local base, `local_theta_key`). `local_*` is the sliding layers' rotary
    where the family gives them their own."""
    params = hf.get("rope_parameters")
    nested = isinstance(params, dict) and bool(set(params) & set(LAYER_TYPES))
    legacy = {**(hf.get("rope_scaling") or {})}
    if nested:
        full = {**legacy, **(params.get(FULL) or {})}
    else:
        full = {**legacy, **(params or {})}
    theta, partial, scaling = _standard_rope(hf, full, float(hf.get("rope_theta") or default_theta))
    out = {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial}
    if nested and params.get(SLIDING) is not None:
        local_theta, _, local_scaling = _standard_rope(hf, params[SLIDING], theta)
        out.update(local_rope_theta=local_theta, local_rope_scaling=local_scaling)
    elif local_theta_key is not None:
        out.update(local_rope_theta=float(hf.get(local_theta_key) or local_default_theta or theta),
                   local_rope_scaling=None)
    return out
