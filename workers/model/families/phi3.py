"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): fused checkpoint tensors, partial rotary, LongRoPE.

What differs from the Llama baseline: the checkpoint stores q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj` (the same concatenations our layers fuse, so they load whole);
only the first `partial_rotary_factor` of each head rotates (Phi-4-mini: 0.75); `rope_scaling`
of type `longrope` switches from its short to its long factors past
`original_max_position_embeddings` (workers/model/rope.py says how tokens and the cache
follow); `sliding_window`, when set, makes every layer slide; no biases.
"""

from __future__ import annotations

from workers.model.families.base import (
    LLAMA_WEIGHTS,
    SLIDING,
    Family,
    activation,
    layer_types,
    rope_fields,
    window,
    with_weights,
)

_FUSED = {
    "model.layers.{i}.self_attn.qkv_proj.weight": ("layers.{i}.attention.wqkv.weight", None),
    "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.feed_forward.w_gate_up.weight", None),
}
_SPLIT = tuple(k for k in LLAMA_WEIGHTS if ".q_proj." in k or ".k_proj." in k or ".v_proj." in k
               or ".gate_proj." in k or ".up_proj." in k)


def _read(hf: dict) -> dict:
    w = window(hf)
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: SLIDING)}


PHI3 = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), with_weights(LLAMA_WEIGHTS, _FUSED, drop=_SPLIT), _read)
