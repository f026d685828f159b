"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama baseline with NoPE layers.

What differs: `no_rope_layers` lists, per layer, 1 where the layer rotates q and k and 0 where
it does not (every fourth layer, `no_rope_layer_interval`, by default); with
`use_sliding_window`, the NoPE layers slide (or as `layer_types` lists them); `attention_bias`
on q/k/v and o, `mlp_bias`.
"""

from __future__ import annotations

from workers.model.families.base import (
    FULL,
    LLAMA_WEIGHTS,
    SLIDING,
    Family,
    FamilyConfigError,
    activation,
    layer_types,
    rope_fields,
    window,
)


def _read(hf: dict) -> dict:
    n = int(hf["num_hidden_layers"])
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses = hf.get("no_rope_layers")
    if uses is None:
        uses = [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses) != n or any(u not in (0, 1, True, False) for u in uses):
        raise FamilyConfigError(f"`no_rope_layers` must list {n} values of 0 or 1, got `{uses}`")
    w = window(hf, bool(hf.get("use_sliding_window")))
    bias = bool(hf.get("attention_bias", False))
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"),
            "nope_layers": tuple(i for i, u in enumerate(uses) if not u), "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: FULL if uses[i] else SLIDING),
            "attention_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), LLAMA_WEIGHTS, _read)
