"""Gemma 2 (`Gemma2ForCausalLM`): sandwich norms, soft-capped attention and logits, alternating
sliding layers.

What differs from the Llama baseline: every RMSNorm is Gemma's (`x * (1 + w)`, computed in fp32
and cast last), and sits both before and after attention and the feed-forward; the activation
is GELU with the tanh approximation (`hidden_activation`); the embeddings are scaled by
sqrt(hidden), as a value of the weights' dtype; attention scores are scaled by
`query_pre_attn_scalar ** -0.5` and soft-capped (`cap * tanh(s / cap)`, `attn_logit_softcapping`),
the logits too (`final_logit_softcapping`); even layers slide over `sliding_window` positions
(or as `layer_types` lists them); the LM head is tied by default.
"""

from __future__ import annotations

from workers.model.families.base import (
    FULL,
    LLAMA_WEIGHTS,
    SLIDING,
    Family,
    activation,
    layer_types,
    refuse,
    rope_fields,
    window,
    with_weights,
)

# Gemma's four norms per layer: before and after attention, before and after the feed-forward.
GEMMA_NORMS = {
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.post_attention_norm.weight", None),
    "model.layers.{i}.pre_feedforward_layernorm.weight": ("layers.{i}.ffn_norm.weight", None),
    "model.layers.{i}.post_feedforward_layernorm.weight": ("layers.{i}.post_ffn_norm.weight", None),
}


def read_gemma(hf: dict, alternate_every: int) -> dict:
    """What Gemma 2 and Gemma 3 share (`alternate_every`: one full layer per that many)."""
    refuse(hf, "use_bidirectional_attention", (None, False), " (a bidirectional decoder)")
    w = window(hf)
    bias = bool(hf.get("attention_bias", False))
    return {
        "activation": activation(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh"),
        "norm_placement": "sandwich", "norm_style": "gemma",
        "attention_scale": float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,
        "embedding_scale": float(hf["hidden_size"]) ** 0.5, "embedding_scale_rounded": True,
        "attention_bias": bias, "o_bias": bias, "sliding_window": w,
        "layer_types": layer_types(hf, w, lambda i: SLIDING if (i + 1) % alternate_every else FULL),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _read(hf: dict) -> dict:
    caps = {"attn_softcap": hf.get("attn_logit_softcapping", 50.0),
            "final_softcap": hf.get("final_logit_softcapping", 30.0)}
    return {**rope_fields(hf), **read_gemma(hf, 2), **{k: None if v is None else float(v) for k, v in caps.items()}}


GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), with_weights(LLAMA_WEIGHTS, GEMMA_NORMS), _read)
