"""Granite 3 (`GraniteForCausalLM`): the Llama baseline with four multipliers.

What differs: the embeddings are multiplied by `embedding_multiplier`, each sub-layer's output
by `residual_multiplier` before it joins the residual, attention scores are scaled by
`attention_multiplier` (instead of `1/sqrt(head_dim)`) and the logits divided by
`logits_scaling`; `attention_bias` on q/k/v and o, `mlp_bias`.
"""

from __future__ import annotations

from workers.model.families.base import LLAMA_WEIGHTS, Family, activation, rope_fields


def _read(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"),
            "embedding_scale": float(hf.get("embedding_multiplier", 1.0)),
            "residual_scale": float(hf.get("residual_multiplier", 1.0)),
            "attention_scale": float(hf.get("attention_multiplier", 1.0)),
            "logits_divisor": float(hf.get("logits_scaling", 1.0)),
            "attention_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


GRANITE = Family("granite", ("GraniteForCausalLM",), ("granite",), LLAMA_WEIGHTS, _read)
