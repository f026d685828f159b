"""Hugging Face tensor names <-> ours, through one explicit map per family, plus shape checks and export.

Design: our layers fuse q/k/v into `wqkv` and gate/up into `w_gate_up` (fewer matmuls per
step), so a Hugging Face tensor maps to (our name, part index); parts are concatenated
along the output dimension in part order (a checkpoint that stores them fused, as Phi-3
does, maps whole). Each family declares its map (workers/model/families/), and the same
map drives loading (`to_ours`), shape validation (`hf_shapes`, checked against the model
built for the config) and export (`to_hf`), so the three cannot drift apart. Trade-off: a
fused tensor is only complete once all its parts are read, so loading holds the parts of one
layer briefly in memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from workers.model.config import ModelConfig
from workers.model.families.registry import family

# Tensors some checkpoints carry that we recompute or do not need.
IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_Compiled = list[tuple[re.Pattern, tuple[str, int | None]]]
_COMPILED: dict[str, _Compiled] = {}


def _patterns(config: ModelConfig) -> _Compiled:
    compiled = _COMPILED.get(config.architecture)
    if compiled is None:
        weights = family(config.architecture).weights
        compiled = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in weights.items()]
        _COMPILED[config.architecture] = compiled
    return compiled


def map_name(hf_name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Our (name, part) for an HF tensor name of this config's family, or None when not in its map."""
    for pattern, (ours, part) in _patterns(config):
        m = pattern.match(hf_name)
        if m:
            return (ours.replace("{i}", m.group(1)) if m.groups() else ours), part
    return None


def _part_sizes(config: ModelConfig, ours: str) -> tuple[int, ...]:
    """How a fused tensor of ours splits along dim 0 into its Hugging Face parts."""
    if ".wqkv." in ours:
        return config.q_size, config.kv_size, config.kv_size
    if ".w_gate_up." in ours:
        return config.intermediate_size, config.intermediate_size
    raise KeyError(ours)


def hf_shapes(config: ModelConfig, ours: Mapping[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config expects, with its shape, given the shapes of the model built
    for it (`ours`: our name -> shape, e.g. from a meta-device model's state dict)."""
    names = [k.replace("{i}", str(i)) if "{i}" in k else k
             for k in family(config.architecture).weights
             for i in (range(config.num_hidden_layers) if "{i}" in k else (None,))]
    shapes = {}
    for hf_name in names:
        target, part = map_name(hf_name, config)
        if target not in ours or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
            continue  # a tensor this config does not have (a bias left off, a tied head)
        shape = tuple(ours[target])
        if part is not None:
            shape = (_part_sizes(config, target)[part], *shape[1:])
        shapes[hf_name] = shape
    return shapes


def to_ours(hf_tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Fuse already-validated HF tensors into our state dict (parts concatenated on dim 0)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_tensors.items():
        mapped = map_name(hf_name, config)
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
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for hf_name in hf_shapes(config, {k: v.shape for k, v in ours.items()}):
        name, part = map_name(hf_name, config)  # type: ignore[misc]
        tensor = ours[name].detach()
        if part is not None:
            tensor = tensor.split(_part_sizes(config, name), dim=0)[part]
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
