"""Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: hybrids of Gated DeltaNet and full attention.

Three of every four layers are Gated DeltaNet linear attention (workers/model/linear_attention.py),
with no KV cache; the others are full attention with Qwen3's per-head q/k norms, a sigmoid output
gate that `q_proj` computes beside each head's query, and a rotary over the first quarter of each
head. Norms scale by `(1 + w)` in fp32; the MoE variants add a shared expert gated by
`sigmoid(x w)`. Qwen3-Next's fused, key-head-grouped DeltaNet projections are turned into Qwen3.5's
order (`layouts`). A `*ForConditionalGeneration` checkpoint is read for its text model (its vision
tower and multi-token prediction head skipped at load with a log line; the head is read on its own
for `--speculative mtp`, workers/model/mtp.py), whose multi-axis rotary is the plain rotary for
text. Trade-off: an image in a prompt is refused upstream (the tokenizer's vision placeholders are
plain tokens here), not approximated."""

from __future__ import annotations

import torch

from workers.model.families.base import (
    FULL,
    LINEAR,
    LLAMA_WEIGHTS,
    QK_NORM_WEIGHTS,
    Family,
    FamilyConfigError,
    refuse,
    rope_fields,
    with_weights,
)
from workers.model.families.moe import EXPERT

_SKIPPED = (r"model\.visual\..*", r"mtp\..*")  # the vision tower; the multi-token prediction head
_DENSE_MLP = tuple(k for k in LLAMA_WEIGHTS if ".mlp." in k)


def _layer_types(hf: dict) -> tuple[str, ...]:
    """`layer_types`, else every `full_attention_interval`-th layer full (transformers' default 4)."""
    n = int(hf["num_hidden_layers"])
    given = hf.get("layer_types")
    if given is None:
        every = int(hf.get("full_attention_interval") or 4)
        given = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if len(given) != n or any(t not in (FULL, LINEAR) for t in given):
        raise FamilyConfigError(f"`layer_types` must list {n} of {FULL}, {LINEAR}, got `{given}`")
    if FULL not in given:
        raise FamilyConfigError(f"`layer_types` `{given}` has no `{FULL}` layer; a model of linear layers only is "
                                f"not supported (at least one {FULL} layer)")
    return tuple(given)


def _common(hf: dict) -> dict:
    """What the three families read alike: the hybrid layer stack and its two attentions. A full
    layer's `q_proj` computes a sigmoid output gate beside each head's query (its rows interleave
    query and gate per head, and our `wqkv` keeps them so); every norm is `(1 + w)` in fp32."""
    refuse(hf, "hidden_act", ("silu", "swish"), " (the DeltaNet's convolution and the MLP use it)")
    refuse(hf, "attn_output_gate", (True,), " (full attention without its output gate)")
    bias = bool(hf.get("attention_bias", False))
    rope = rope_fields({"partial_rotary_factor": 0.25, **hf})  # transformers' default for these families
    return {**rope, "norm_style": "gemma", "qk_norm": "head", "attention_bias": bias, "o_bias": bias,
            "attn_output_gate": True, "layer_types": _layer_types(hf),
            "linear_num_key_heads": int(hf.get("linear_num_key_heads", 16)),
            "linear_num_value_heads": int(hf.get("linear_num_value_heads", 32)),
            "linear_key_head_dim": int(hf.get("linear_key_head_dim", 128)),
            "linear_value_head_dim": int(hf.get("linear_value_head_dim", 128)),
            "linear_conv_kernel": int(hf.get("linear_conv_kernel_dim", 4))}


def _experts(hf: dict, sparse: tuple[int, ...], norm_topk: bool) -> dict:
    count, top_k = hf.get("num_experts"), hf.get("num_experts_per_tok")
    if not isinstance(count, int) or not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise FamilyConfigError(f"`num_experts` `{count}` and `num_experts_per_tok` `{top_k}` must be integers with "
                                f"1 <= top-k <= experts")
    return {"num_experts": count, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "sparse_layers": sparse, "norm_topk_prob": norm_topk,
            "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0)}


def _read_dense(hf: dict) -> dict:
    return _common(hf)


def _read_moe(hf: dict) -> dict:  # Qwen3.5-MoE: every layer sparse, top-k always renormalized
    return {**_common(hf), **_experts(hf, tuple(range(int(hf["num_hidden_layers"]))), True)}


def _read_next(hf: dict) -> dict:  # Qwen3-Next: Qwen3-MoE's sparse steps and dense layers
    n, step = int(hf["num_hidden_layers"]), int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    experts = int(hf.get("num_experts") or 0)
    sparse = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return {**_common(hf), **_experts(hf, sparse, bool(hf.get("norm_topk_prob", True)))}


# -- tensors -----------------------------------------------------------------------------------

_LINEAR = {  # the DeltaNet's own tensors (Qwen3.5 names; Qwen3-Next fuses the projections)
    "model.layers.{i}.linear_attn.conv1d.weight": ("layers.{i}.attention.conv_weight", None),
    "model.layers.{i}.linear_attn.dt_bias": ("layers.{i}.attention.dt_bias", None),
    "model.layers.{i}.linear_attn.A_log": ("layers.{i}.attention.A_log", None),
    "model.layers.{i}.linear_attn.norm.weight": ("layers.{i}.attention.norm.weight", None),
    "model.layers.{i}.linear_attn.out_proj.weight": ("layers.{i}.attention.out_proj.weight", None),
}
_QWEN3_5_PROJECTIONS = {
    "model.layers.{i}.linear_attn.in_proj_qkv.weight": ("layers.{i}.attention.in_proj_qkvz.weight", 0),
    "model.layers.{i}.linear_attn.in_proj_z.weight": ("layers.{i}.attention.in_proj_qkvz.weight", 1),
    "model.layers.{i}.linear_attn.in_proj_b.weight": ("layers.{i}.attention.in_proj_ba.weight", 0),
    "model.layers.{i}.linear_attn.in_proj_a.weight": ("layers.{i}.attention.in_proj_ba.weight", 1),
}
_NEXT_PROJECTIONS = {
    "model.layers.{i}.linear_attn.in_proj_qkvz.weight": ("layers.{i}.attention.in_proj_qkvz.weight",
                                                          "qkvz_by_key_head"),
    "model.layers.{i}.linear_attn.in_proj_ba.weight": ("layers.{i}.attention.in_proj_ba.weight", "ba_by_key_head"),
}
_MOE = {
    "model.layers.{i}.mlp.gate.weight": ("layers.{i}.feed_forward.router.weight", None),
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": ("layers.{i}.feed_forward.experts.w_gate_up", (EXPERT, 0)),
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": ("layers.{i}.feed_forward.experts.w_gate_up", (EXPERT, 1)),
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": ("layers.{i}.feed_forward.experts.w_down", (EXPERT, None)),
    "model.layers.{i}.mlp.shared_expert.gate_proj.weight": ("layers.{i}.feed_forward.shared_expert.w_gate_up.weight",
                                                            0),
    "model.layers.{i}.mlp.shared_expert.up_proj.weight": ("layers.{i}.feed_forward.shared_expert.w_gate_up.weight",
                                                          1),
    "model.layers.{i}.mlp.shared_expert.down_proj.weight": ("layers.{i}.feed_forward.shared_expert.w_down.weight",
                                                            None),
    "model.layers.{i}.mlp.shared_expert_gate.weight": ("layers.{i}.feed_forward.shared_expert_gate.weight", None),
}
_HYBRID = with_weights(LLAMA_WEIGHTS, {**QK_NORM_WEIGHTS, **_LINEAR})


def _heads_to_pieces(t: torch.Tensor, sizes: tuple[int, ...], heads: int) -> torch.Tensor:
    """Rows grouped by key head (each head: `sizes` rows of its pieces) -> each piece's rows of every
    head together, piece after piece: [heads * sum(sizes), H] -> the same rows reordered."""
    groups = t.unflatten(0, (heads, sum(sizes)))  # [Hk, rows per head, H]
    return torch.cat([p.flatten(0, 1) for p in groups.split(sizes, dim=1)], dim=0)


def _pieces_to_heads(t: torch.Tensor, sizes: tuple[int, ...], heads: int) -> torch.Tensor:
    """The inverse of `_heads_to_pieces` (export: `weights.to_hf`)."""
    pieces = [p.unflatten(0, (heads, -1)) for p in t.split([s * heads for s in sizes], dim=0)]  # [Hk, s, H] each
    return torch.cat(pieces, dim=1).flatten(0, 1)


def _next_layouts(config) -> dict[str, tuple]:
    """Qwen3-Next's fused projections: per key head its q, k, then its `r = Hv / Hk` value heads' v
    and z (and b, a), which ours orders as all of q, all of k, v, z (b, a) as Qwen3.5 stores them."""
    hk, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    out = {}
    for name, sizes in (("qkvz_by_key_head", (dk, dk, r * dv, r * dv)), ("ba_by_key_head", (r, r))):
        out[name] = (lambda t, s=sizes: _heads_to_pieces(t, s, hk), lambda t, s=sizes: _pieces_to_heads(t, s, hk),
                     tuple)
    return out


QWEN3_5 = Family("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_text", "qwen3_5"),
                 with_weights(_HYBRID, _QWEN3_5_PROJECTIONS), _read_dense, skipped=_SKIPPED)
QWEN3_5_MOE = Family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                     ("qwen3_5_moe_text", "qwen3_5_moe"),
                     with_weights(_HYBRID, {**_QWEN3_5_PROJECTIONS, **_MOE}, drop=_DENSE_MLP), _read_moe,
                     skipped=_SKIPPED)
QWEN3_NEXT = Family("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",),
                    with_weights(_HYBRID, {**_NEXT_PROJECTIONS, **_MOE}), _read_next, layouts=_next_layouts,
                    skipped=_SKIPPED)
