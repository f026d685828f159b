"""Hugging Face tensor names <-> ours, in ONE explicit map, plus shape checks and export.

Design: our layers fuse q/k/v into `wqkv` and gate/up into `w_gate_up` (fewer matmuls per
step), so a Hugging Face tensor maps to (our name, part index); parts are concatenated
along the output dimension in part order. The same table drives loading
(`to_ours`), shape validation (`hf_shapes`) and export (`to_hf`), so the three cannot
drift apart. Trade-off: a fused tensor is only complete once all its parts are read, so
loading holds the parts of one layer briefly in memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from workers.model.config import ModelConfig

# HF name (with {i} for the layer) -> (our name, part index within the fused tensor, or None)
HF_TO_OURS: dict[str, tuple[str, int | None]] = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", None),
    "model.norm.weight": ("norm.weight", None),
    "lm_head.weight": ("output.weight", None),
    "model.layers.{i}.input_layernorm.weight": ("layers.{i}.attention_norm.weight", None),
    "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.attention.wqkv.weight", 0),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.attention.wqkv.weight", 1),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.attention.wqkv.weight", 2),
    "model.layers.{i}.self_attn.q_proj.bias": ("layers.{i}.attention.wqkv.bias", 0),
    "model.layers.{i}.self_attn.k_proj.bias": ("layers.{i}.attention.wqkv.bias", 1),
    "model.layers.{i}.self_attn.v_proj.bias": ("layers.{i}.attention.wqkv.bias", 2),
    "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.attention.wo.weight", None),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.ffn_norm.weight", None),
    "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.feed_forward.w_gate_up.weight", 0),
    "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.feed_forward.w_gate_up.weight", 1),
    "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.feed_forward.w_down.weight", None),
}
# Tensors some checkpoints carry that we recompute or do not need.
IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in HF_TO_OURS.items()]


def map_name(hf_name: str) -> tuple[str, int | None] | None:
    """Our (name, part) for an HF tensor name, or None when the name is not in the map."""
    for pattern, (ours, part) in _PATTERNS:
        m = pattern.match(hf_name)
        if m:
            return (ours.replace("{i}", m.group(1)) if m.groups() else ours), part
    return None


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config expects, with its shape."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    if config.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for layer in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{k}": v for k, v in per_layer.items()})
    return shapes


def to_ours(hf_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fuse already-validated HF tensors into our state dict (parts concatenated on dim 0)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_tensors.items():
        mapped = map_name(hf_name)
        assert mapped is not None, hf_name  # callers filter unknown names first
        ours, part = mapped
        if part is None:
            out[ours] = tensor
        else:
            parts.setdefault(ours, {})[part] = tensor
    for ours, pieces in parts.items():
        out[ours] = torch.cat([pieces[k] for k in sorted(pieces)], dim=0)
    return out


def to_hf(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's weights under HF names (fused tensors split back), contiguous, detached."""
    config: ModelConfig = model.config
    split = {
        "wqkv": (config.q_size, config.kv_size, config.kv_size),
        "w_gate_up": (config.intermediate_size, config.intermediate_size),
    }
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for hf_name in hf_shapes(config):
        name, part = map_name(hf_name)  # type: ignore[misc]
        tensor = ours[name].detach()
        if part is not None:
            kind = "wqkv" if ".wqkv." in name else "w_gate_up"
            tensor = tensor.split(split[kind], dim=0)[part]
        out[hf_name] = tensor.contiguous().clone()
    return out


def save_hf_checkpoint(model: torch.nn.Module, out_dir, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors` (HF names) for `model` into `out_dir`.

    Tokenizer files are the caller's; `workers.model.loader.load_model` reads the result back and
    so does transformers' `LlamaForCausalLM.from_pretrained`.
    """
    import json
    from dataclasses import replace
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    saved_dtype = next(iter(tensors.values())).dtype
    config = replace(model.config, torch_dtype=str(saved_dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
