"""OLMo 2 (`Olmo2ForCausalLM`) and OLMo 3 (`Olmo3ForCausalLM`): post-norm layers and q/k norms
over the whole projection.

What differs from the Llama baseline: no norm before attention or the feed-forward; each
sub-layer's output is normalised before it joins the residual (`post_attention_layernorm`,
`post_feedforward_layernorm`), with OLMo's RMSNorm (`w * x` in fp32, cast last); q and k are
each normalised over their whole projection, before they are split into heads; `attention_bias`
on q/k/v and o. OLMo 3 also slides three layers of four (`layer_types`, `sliding_window`),
with a rotary set per layer type (transformers 5's `rope_parameters`).
"""

from __future__ import annotations

from workers.model.families.base import (
    FULL,
    LLAMA_WEIGHTS,
    QK_NORM_WEIGHTS,
    SLIDING,
    Family,
    activation,
    layer_types,
    rope_fields,
    window,
    with_weights,
)

_WEIGHTS = with_weights(
    LLAMA_WEIGHTS, QK_NORM_WEIGHTS, drop=("model.layers.{i}.input_layernorm.weight",),
    rename={
        "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.post_attention_norm.weight", None),
        "model.layers.{i}.post_feedforward_layernorm.weight": ("layers.{i}.post_ffn_norm.weight", None),
    },
)


def _common(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"activation": activation(hf, "hidden_act"), "norm_placement": "post", "norm_style": "fp32",
            "qk_norm": "projection", "attention_bias": bias, "o_bias": bias}


def _read_olmo2(hf: dict) -> dict:
    return {**rope_fields(hf), **_common(hf)}


def _read_olmo3(hf: dict) -> dict:
    w = window(hf)
    return {**rope_fields(hf, 500_000.0), **_common(hf), "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: SLIDING if (i + 1) % 4 else FULL)}


OLMO2 = Family("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), _WEIGHTS, _read_olmo2)
OLMO3 = Family("olmo3", ("Olmo3ForCausalLM",), ("olmo3",), _WEIGHTS, _read_olmo3)
