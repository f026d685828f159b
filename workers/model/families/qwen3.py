"""Qwen3 (`Qwen3ForCausalLM`): the Llama baseline with an RMSNorm over each head of q and k
(before the rotary), `attention_bias` on q/k/v and o, and sliding layers from
`max_window_layers` on when `use_sliding_window` is set (or as `layer_types` lists them)."""

from __future__ import annotations

from workers.model.families.base import (
    LLAMA_WEIGHTS,
    QK_NORM_WEIGHTS,
    Family,
    activation,
    qwen_layer_types,
    rope_fields,
    window,
    with_weights,
)


def _read(hf: dict) -> dict:
    w = window(hf, bool(hf.get("use_sliding_window")))
    bias = bool(hf.get("attention_bias", False))
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "qk_norm": "head", "attention_bias": bias,
            "o_bias": bias, "sliding_window": w, "layer_types": qwen_layer_types(hf, w)}


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), with_weights(LLAMA_WEIGHTS, QK_NORM_WEIGHTS), _read)
