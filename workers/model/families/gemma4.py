"""Gemma 4 text (`Gemma4ForCausalLM`, model type `gemma4_text`) and the text part of its
multimodal checkpoints (`Gemma4ForConditionalGeneration`, `gemma4`: its `text_config`, weights
under `model.language_model.`; the vision and audio towers are skipped at load).

What differs from Gemma 3: global layers with their own head dim and KV heads
(workers/model/layer_shapes.py) and the `proportional` rotary (workers/model/rope.py),
`attention_k_eq_v`, a value norm and Gemma 4's norms, unscaled scores with a final logit
soft-cap, KV shared by the last `num_kv_shared_layers` layers, per-layer inputs
(workers/model/per_layer_inputs.py), a `layer_scalar` per layer and the MoE block beside the MLP
(workers/model/moe_block.py); `_read` lists each switch. Refused by name: `use_bidirectional_attention:
all` (an encoder), per-layer overrides other than a global layer's head dim and KV heads, KV
sharing with no producer."""

from __future__ import annotations

import logging

from workers.model.families.base import (
    FULL,
    LLAMA_WEIGHTS,
    QK_NORM_WEIGHTS,
    SLIDING,
    Family,
    FamilyConfigError,
    activation,
    layer_types,
    refuse,
    rope_fields,
    window,
    with_weights,
)
from workers.model.families.gemma2 import GEMMA_NORMS

logger = logging.getLogger(__name__)

DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_OVERRIDES = ("head_dim", "num_key_value_heads")  # what `per_layer_config` may set, on global layers


def _types(hf: dict, w: int | None) -> tuple:
    """Five sliding layers to one global (or `layer_types`), the last one always global."""
    types = list(layer_types(hf, w, lambda i: SLIDING if (i + 1) % 6 else FULL))
    if types[-1] != FULL:
        logger.warning("Gemma 4's last layer attends fully (`layer_types` ends with `%s`): forced to %s",
                       types[-1], FULL)
        types[-1] = FULL
    return tuple(types)


def _global_shape(hf: dict, types: tuple) -> dict:
    """The global layers' head dim and KV heads: `per_layer_config` (transformers 5), else
    `global_head_dim` (512 by default) and, where `attention_k_eq_v`, `num_global_key_value_heads`."""
    given = hf.get("per_layer_config")
    if given is None:
        kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v", False) else None
        return {"global_head_dim": int(hf.get("global_head_dim") or 512), "global_kv_heads": int(kv or 0)}
    per_layer = {int(k): dict(v or {}) for k, v in given.items()}
    for i, over in per_layer.items():
        bad = sorted(set(over) - set(_OVERRIDES))
        if bad or (over and (i >= len(types) or types[i] != FULL)):
            what = f"`{bad[0]}`" if bad else f"an override of layer {i} ({types[i] if i < len(types) else 'absent'})"
            raise FamilyConfigError(f"`per_layer_config` sets {what}. Supported: {', '.join(_OVERRIDES)} of "
                                    f"full-attention layers")
    shapes = {tuple(sorted(per_layer.get(i, {}).items())) for i, t in enumerate(types) if t == FULL}
    if len(shapes) > 1:
        raise FamilyConfigError(f"`per_layer_config` gives full-attention layers different shapes `{sorted(shapes)}`. "
                                f"Supported: one shape per layer type")
    over = dict(next(iter(shapes), ()))
    return {"global_head_dim": int(over.get("head_dim") or 0),
            "global_kv_heads": int(over.get("num_key_value_heads") or 0)}


def _shared(hf: dict, types: tuple) -> int:
    """`num_kv_shared_layers`, checked: each sharing layer's type has a producer before them."""
    n, shared = len(types), int(hf.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise FamilyConfigError(f"`num_kv_shared_layers` `{shared}` must be 0..{n - 1}: the KV of every layer "
                                f"sharing it comes from an earlier layer of this checkpoint")
    if shared and not set(types[n - shared:]) <= set(types[: n - shared]):
        raise FamilyConfigError(f"`num_kv_shared_layers` `{shared}`: a sharing layer's type has no earlier layer of "
                                f"its type to read the KV of (`layer_types` `{list(types)}`)")
    return shared


def _rope(hf: dict) -> dict:
    out = rope_fields({**hf, "rope_parameters": hf.get("rope_parameters") or DEFAULT_ROPE}, 1_000_000.0)
    scaling = out["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "proportional":  # its factor rides with its spec
        out["rope_scaling"] = {**scaling, "partial_rotary_factor": out["partial_rotary_factor"]}
        out["partial_rotary_factor"] = 1.0
    local = (hf.get("rope_parameters") or DEFAULT_ROPE).get(SLIDING) or {}
    refuse(local, "partial_rotary_factor", (None, 1, 1.0), " on sliding layers")
    return out


def _experts(hf: dict, n: int) -> dict:
    if not hf.get("enable_moe_block"):
        return {}
    count, top_k, width = hf.get("num_experts"), hf.get("top_k_experts"), hf.get("moe_intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (count, top_k, width)) or top_k > count:
        raise FamilyConfigError(f"`enable_moe_block` needs `num_experts` `{count}`, `top_k_experts` `{top_k}` and "
                                f"`moe_intermediate_size` `{width}` as positive integers with top-k <= experts")
    return {"num_experts": count, "num_experts_per_tok": top_k, "moe_intermediate_size": width, "moe_block": True,
            "sparse_layers": tuple(range(n)), "router": "gemma4", "norm_topk_prob": True,
            "expert_activation": activation(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")}


def _read(hf: dict) -> dict:
    """A Gemma 4 checkpoint's switches: every norm Gemma 4's (`w * x` in fp32 with
    `pow(mean + eps, -0.5)`), q and k normed per head as in Gemma 3 and values by a scale-less
    norm; scores unscaled (`scaling` 1.0) and not soft-capped, the final logits capped; the global
    layers' `proportional` rotary, the sliding ones' default rotary; `attention_k_eq_v` (a global
    layer's values are its key projection, normed by the value norm and never rotated);
    `use_double_wide_mlp` (the KV-sharing layers' MLP twice as wide); per-layer inputs of
    `hidden_size_per_layer_input` values (256 by default); a `layer_scalar` per layer; and with
    `enable_moe_block` the experts beside the dense MLP."""
    refuse(hf, "use_bidirectional_attention", (None, "vision"), " (`all`: a bidirectional encoder)")
    w = window({"sliding_window": 512, **hf})  # transformers' default window
    types = _types(hf, w)
    bias = bool(hf.get("attention_bias", False))
    per_layer = int(hf.get("hidden_size_per_layer_input", 256) or 0)
    return {
        **_rope(hf), **_global_shape(hf, types), **_experts(hf, len(types)),
        "activation": activation(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        "norm_placement": "sandwich", "norm_style": "gemma4", "qk_norm": "head", "v_norm": True,
        "attention_scale": 1.0, "attention_bias": bias, "o_bias": bias, "sliding_window": w, "layer_types": types,
        "final_softcap": None if hf.get("final_logit_softcapping") is None else float(hf["final_logit_softcapping"]),
        "embedding_scale": float(hf["hidden_size"]) ** 0.5, "embedding_scale_rounded": True,
        "attention_k_eq_v": bool(hf.get("attention_k_eq_v", False)), "kv_shared_layers": _shared(hf, types),
        "double_wide_mlp": bool(hf.get("use_double_wide_mlp", False)), "layer_scalar": True,
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": int(hf.get("vocab_size_per_layer_input", 262_144)) if per_layer else 0,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


_LAYER = "model.layers.{i}."
WEIGHTS = with_weights(LLAMA_WEIGHTS, {
    **GEMMA_NORMS, **QK_NORM_WEIGHTS,
    _LAYER + "layer_scalar": ("layers.{i}.layer_scalar", None),
    # per-layer inputs: the packed table, the projection of the embeddings, and each layer's gate
    "model.embed_tokens_per_layer.weight": ("per_layer_inputs.embed.weight", None),
    "model.per_layer_model_projection.weight": ("per_layer_inputs.projection.weight", None),
    "model.per_layer_projection_norm.weight": ("per_layer_inputs.norm.weight", None),
    _LAYER + "per_layer_input_gate.weight": ("layers.{i}.per_layer.gate.weight", None),
    _LAYER + "per_layer_projection.weight": ("layers.{i}.per_layer.projection.weight", None),
    _LAYER + "post_per_layer_input_norm.weight": ("layers.{i}.per_layer.norm.weight", None),
    # the MoE block beside the dense MLP: router, experts (our stacked layout already) and norms
    _LAYER + "router.proj.weight": ("layers.{i}.moe_block.router.weight", None),
    _LAYER + "router.scale": ("layers.{i}.moe_block.router_scale", None),
    _LAYER + "router.per_expert_scale": ("layers.{i}.moe_block.per_expert_scale", None),
    _LAYER + "experts.gate_up_proj": ("layers.{i}.moe_block.experts.w_gate_up", None),
    _LAYER + "experts.down_proj": ("layers.{i}.moe_block.experts.w_down", None),
    _LAYER + "post_feedforward_layernorm_1.weight": ("layers.{i}.moe_block.post_dense_norm.weight", None),
    _LAYER + "pre_feedforward_layernorm_2.weight": ("layers.{i}.moe_block.pre_norm.weight", None),
    _LAYER + "post_feedforward_layernorm_2.weight": ("layers.{i}.moe_block.post_norm.weight", None),
})

# a multimodal checkpoint's towers, which this server does not run (its text part is read as
# Gemma4ForCausalLM's: `text_config`, weights under `model.language_model.`)
TOWERS = (r"model\.(vision_tower|embed_vision|audio_tower|embed_audio)\..*",)

GEMMA4 = Family("gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4_text", "gemma4"),
                WEIGHTS, _read, skipped=TOWERS)
