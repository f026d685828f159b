"""The mixture-of-experts families: Qwen3-MoE, Mixtral and gpt-oss.

What they share with their dense relatives is read as those read it (Qwen3's attention with
per-head q/k norms; Mistral's; gpt-oss's biased attention with learned sinks, YaRN and
alternating 128-position windows). What the experts add: their count and top-k, the router
(softmax then top-k, renormalized where `norm_topk_prob` asks, as Mixtral always does; or
gpt-oss's top-k of biased logits then softmax over them), which layers are sparse (Qwen3-MoE's
`decoder_sparse_step` and `mlp_only_layers`: the others keep a dense feed-forward), and the
expert tensors: one per expert and projection (Qwen3-MoE, Mixtral's w1/w3/w2), or gpt-oss's
stacked, transposed gate/up with gate and up interleaved, which the weight map turns into our
layout (workers/model/moe.py).
"""

from __future__ import annotations

from workers.model.families.base import (
    LLAMA_WEIGHTS,
    QK_NORM_WEIGHTS,
    SLIDING,
    Family,
    FamilyConfigError,
    activation,
    layer_types,
    qwen_layer_types,
    refuse,
    rope_fields,
    window,
    with_weights,
)

EXPERT = "expert"  # workers/model/weights.py: expert {e}'s tensor (or a piece of it), stacked
_DENSE_MLP = tuple(k for k in LLAMA_WEIGHTS if ".mlp." in k)
_ATTENTION = with_weights(LLAMA_WEIGHTS, drop=_DENSE_MLP)


def _experts(hf: dict, count_keys: tuple[str, ...]) -> dict:
    """`num_experts` and `num_experts_per_tok` (transformers 4 and 5 spell the count differently)."""
    count = next((hf[k] for k in count_keys if hf.get(k)), None)
    top_k = hf.get("num_experts_per_tok")
    if not isinstance(count, int) or not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise FamilyConfigError(f"`{count_keys[0]}` `{count}` and `num_experts_per_tok` `{top_k}` must be integers "
                                f"with 1 <= top-k <= experts")
    return {"num_experts": count, "num_experts_per_tok": top_k}


# -- Qwen3-MoE ---------------------------------------------------------------------------------

def _read_qwen3_moe(hf: dict) -> dict:
    w = window(hf, bool(hf.get("use_sliding_window")))
    bias = bool(hf.get("attention_bias", False))
    n, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    experts = _experts(hf, ("num_experts", "num_local_experts"))
    sparse = tuple(i for i in range(n) if i not in dense and experts["num_experts"] > 0 and (i + 1) % step == 0)
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "qk_norm": "head", "attention_bias": bias,
            "o_bias": bias, "sliding_window": w, "layer_types": qwen_layer_types(hf, w), **experts,
            "moe_intermediate_size": int(hf["moe_intermediate_size"]), "sparse_layers": sparse,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), with_weights(LLAMA_WEIGHTS, {
    **QK_NORM_WEIGHTS,
    "model.layers.{i}.mlp.gate.weight": ("layers.{i}.feed_forward.router.weight", None),
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": ("layers.{i}.feed_forward.experts.w_gate_up", (EXPERT, 0)),
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": ("layers.{i}.feed_forward.experts.w_gate_up", (EXPERT, 1)),
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": ("layers.{i}.feed_forward.experts.w_down", (EXPERT, None)),
}), _read_qwen3_moe)


# -- Mixtral -----------------------------------------------------------------------------------

def _read_mixtral(hf: dict) -> dict:
    refuse(hf, "router_jitter_noise", (None, 0, 0.0), " (router noise is a training option)")
    w = window(hf)
    return {**rope_fields(hf), "activation": activation(hf, "hidden_act"), "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: SLIDING), **_experts(hf, ("num_local_experts",)),
            "moe_intermediate_size": int(hf["intermediate_size"]),
            "sparse_layers": tuple(range(int(hf["num_hidden_layers"]))), "norm_topk_prob": True}


MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), with_weights(_ATTENTION, add={
    "model.layers.{i}.block_sparse_moe.gate.weight": ("layers.{i}.feed_forward.router.weight", None),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": ("layers.{i}.feed_forward.experts.w_gate_up",
                                                                (EXPERT, 0)),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": ("layers.{i}.feed_forward.experts.w_gate_up",
                                                                (EXPERT, 1)),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": ("layers.{i}.feed_forward.experts.w_down",
                                                                (EXPERT, None)),
}), _read_mixtral)


# -- gpt-oss -----------------------------------------------------------------------------------

def _read_gpt_oss(hf: dict) -> dict:
    w = window(hf)
    return {**rope_fields(hf, 150000.0), "attention_bias": True, "o_bias": True, "attention_sinks": True,
            "sliding_window": w,
            "layer_types": layer_types(hf, w, lambda i: SLIDING if i % 2 == 0 else "full_attention"),
            **_experts(hf, ("num_local_experts", "num_experts")), "moe_intermediate_size": int(hf["intermediate_size"]),
            "sparse_layers": tuple(range(int(hf["num_hidden_layers"]))), "router": "topk_softmax",
            "router_bias": True, "expert_bias": True, "expert_activation": "swiglu_oai",
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)), "swiglu_limit": float(hf.get("swiglu_limit", 7.0))}


GPT_OSS = Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), with_weights(_ATTENTION, add={
    "model.layers.{i}.self_attn.sinks": ("layers.{i}.attention.paged.sinks", None),
    "model.layers.{i}.mlp.router.weight": ("layers.{i}.feed_forward.router.weight", None),
    "model.layers.{i}.mlp.router.bias": ("layers.{i}.feed_forward.router.bias", None),
    "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.feed_forward.experts.w_gate_up", "gate_up_interleaved_t"),
    "model.layers.{i}.mlp.experts.gate_up_proj_bias": ("layers.{i}.feed_forward.experts.b_gate_up",
                                                       "gate_up_bias_interleaved"),
    "model.layers.{i}.mlp.experts.down_proj": ("layers.{i}.feed_forward.experts.w_down", "experts_t"),
    "model.layers.{i}.mlp.experts.down_proj_bias": ("layers.{i}.feed_forward.experts.b_down", None),
}), _read_gpt_oss)
