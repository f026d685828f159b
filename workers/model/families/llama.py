"""The Llama baseline, and the families that are it with a switch or two: Mistral and Qwen2.

Every other family declares what differs from this: a pre-norm decoder (RMSNorm before
attention and before the feed-forward, `w * x` after the fp32 normalisation), SwiGLU, RoPE on
the whole head, grouped-query attention scaled by `1/sqrt(head_dim)`, an untied or tied LM
head. Switches: `attention_bias` (q/k/v and o projections), `mlp_bias`; Mistral's
`sliding_window` makes every layer slide; Qwen2 always has q/k/v biases (its config has no
`attention_bias`), none on o, and slides the layers from `max_window_layers` on when
`use_sliding_window` is set.
"""

from __future__ import annotations

from workers.model.families.base import (
    LLAMA_WEIGHTS,
    SLIDING,
    Family,
    activation,
    layer_types,
    qwen_layer_types,
    refuse,
    rope_fields,
    window,
)


def _read_llama(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "attention_bias": bias, "o_bias": bias,
            "mlp_bias": bool(hf.get("mlp_bias", False))}


def _read_mistral(hf: dict) -> dict:
    w = window(hf)
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: SLIDING)}


def _read_qwen2(hf: dict) -> dict:
    w = window(hf, bool(hf.get("use_sliding_window")))
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "attention_bias": True, "o_bias": False,
            "sliding_window": w, "layer_types": qwen_layer_types(hf, w)}


def _refuse_common(hf: dict) -> None:
    refuse(hf, "pretraining_tp", (None, 1), " (tensor-parallel pretraining slices)")


LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",), LLAMA_WEIGHTS,
               lambda hf: (_refuse_common(hf), _read_llama(hf))[1], "LlamaForCausalLM")
MISTRAL = Family("mistral", ("MistralForCausalLM",), ("mistral",), LLAMA_WEIGHTS, _read_mistral, "MistralForCausalLM")
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), LLAMA_WEIGHTS, _read_qwen2, "Qwen2ForCausalLM")
