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
from workers.model.families.moe import EXPERT  # a part `(EXPERT, piece)`: expert `{e}`'s tensor, stacked
from workers.model.families.registry import family

# Tensors some checkpoints carry that we recompute or do not need.
IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
TEXT_PREFIX = "model.language_model."  # where a multimodal checkpoint keeps its text model (transformers 5)


def text_name(hf_name: str) -> str:
    """A tensor's name in the text model: a multimodal checkpoint's `model.language_model.X` is `model.X`."""
    return "model." + hf_name[len(TEXT_PREFIX) :] if hf_name.startswith(TEXT_PREFIX) else hf_name


def skipped(hf_name: str, config: ModelConfig) -> str | None:
    """The pattern of the family's `skipped` tensors (a vision tower, ...) that `hf_name` matches, if any."""
    return next((p for p in family(config.architecture).skipped if re.fullmatch(p, hf_name)), None)

_Compiled = list[tuple[re.Pattern, tuple[str, object]]]
_COMPILED: dict[str, _Compiled] = {}


def _patterns(config: ModelConfig) -> _Compiled:
    compiled = _COMPILED.get(config.architecture)
    if compiled is None:
        weights = family(config.architecture).weights
        compiled = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
                                + "$"), v) for k, v in weights.items()]
        _COMPILED[config.architecture] = compiled
    return compiled


def map_name(hf_name: str, config: ModelConfig) -> tuple[str, object] | None:
    """Our (name, part) for an HF tensor name of this config's family, or None when not in its map.
    `part`: None (whole), an int (a piece of a tensor fused on dim 0), `(EXPERT, e, piece)` (expert
    `e` of stacked experts, `piece` of it or None), or a layout name of `TRANSFORMS`."""
    for pattern, (ours, part) in _patterns(config):
        m = pattern.match(hf_name)
        if m:
            groups = m.groupdict()
            if groups.get("i") is not None:
                ours = ours.replace("{i}", groups["i"])
            if isinstance(part, tuple) and part[0] == EXPERT:
                part = (EXPERT, int(groups["e"]), part[1])
            return ours, part
    return None


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up columns (gate at even, up at odd: gpt-oss) -> gate then up."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


# layout name -> (HF -> ours, ours -> HF, our shape -> HF shape)
TRANSFORMS = {
    # gpt-oss experts: gate_up [E, H, 2I] interleaved -> [E, 2I, H] gate rows then up rows
    "gate_up_interleaved_t": (lambda t: _deinterleave(t, 2).transpose(1, 2),
                              lambda t: _interleave(t.transpose(1, 2), 2),
                              lambda s: (s[0], s[2], s[1])),
    "gate_up_bias_interleaved": (lambda t: _deinterleave(t, 1), lambda t: _interleave(t, 1), lambda s: tuple(s)),
    # [E, I, H] -> [E, H, I]
    "experts_t": (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2), lambda s: (s[0], s[2], s[1])),
}


def _layouts(config: ModelConfig) -> dict:
    """`TRANSFORMS` and the family's own layouts, which depend on the config (Qwen3-Next's)."""
    own = family(config.architecture).layouts
    return {**TRANSFORMS, **own(config)} if own else TRANSFORMS


def _part_sizes(config: ModelConfig, ours: str) -> tuple[int, ...]:
    """How a fused tensor of ours splits along dim 0 (of each expert) into its Hugging Face parts
    (a part of 0 rows: one the layer does not have, as Gemma 4's KV-sharing layers' k and v)."""
    layer = int(ours.split(".")[1]) if ours.startswith("layers.") and config.has_layer_shapes else None
    if layer is not None and ".wqkv." in ours:
        return config.layer_qkv_sizes(layer)
    if layer is not None and ".feed_forward.w_gate_up." in ours:
        return (config.layer_intermediate_size(layer),) * 2
    if ".wqkv." in ours:  # a gated attention's q part is each head's query and gate
        return config.q_size * (2 if config.attn_output_gate else 1), config.kv_size, config.kv_size
    if ".in_proj_qkvz." in ours:  # a DeltaNet's [q | k | v] and z
        return config.linear_conv_dim, config.linear_value_size
    if ".in_proj_ba." in ours:
        return config.linear_num_value_heads, config.linear_num_value_heads
    if ".shared_expert.w_gate_up." in ours:
        return config.shared_expert_intermediate_size, config.shared_expert_intermediate_size
    if ours.endswith("experts.w_gate_up"):
        return config.moe_intermediate_size, config.moe_intermediate_size
    if ".w_gate_up." in ours:
        return config.intermediate_size, config.intermediate_size
    raise KeyError(ours)


def _expand(config: ModelConfig, key: str) -> list[str]:
    """The HF names a map key stands for: each layer for `{i}`, each expert for `{e}`."""
    names = [key]
    for slot, count in (("{i}", config.num_hidden_layers), ("{e}", config.num_experts)):
        names = [n.replace(slot, str(j)) for n in names for j in range(count)] if slot in key else names
    return names


def hf_shapes(config: ModelConfig, ours: Mapping[str, torch.Size]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config expects, with its shape, given the shapes of the model built
    for it (`ours`: our name -> shape, e.g. from a meta-device model's state dict)."""
    shapes, layouts = {}, _layouts(config)
    for key in family(config.architecture).weights:
        for hf_name in _expand(config, key):
            target, part = map_name(hf_name, config)
            if target not in ours or (hf_name == "lm_head.weight" and config.tie_word_embeddings):
                continue  # a tensor this config does not have (a bias left off, a tied head, a dense layer's experts)
            shape = tuple(ours[target])
            if isinstance(part, tuple):  # one expert's tensor, or a piece of it
                shape = shape[1:] if part[2] is None else (_part_sizes(config, target)[part[2]], *shape[2:])
            elif isinstance(part, str):
                shape = layouts[part][2](shape)
            elif part is not None:
                shape = (_part_sizes(config, target)[part], *shape[1:])
                if shape[0] == 0:
                    continue  # a projection this layer does not have
            shapes[hf_name] = shape
    return shapes


def to_ours(hf_tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Fuse already-validated HF tensors into our state dict (parts concatenated on dim 0,
    experts stacked, gpt-oss layouts turned into ours)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    experts: dict[str, dict[int, dict]] = {}
    out: dict[str, torch.Tensor] = {}
    layouts = _layouts(config)
    for hf_name, tensor in hf_tensors.items():
        mapped = map_name(hf_name, config)
        assert mapped is not None, hf_name  # callers filter unknown names first
        ours, part = mapped
        if part is None:
            out[ours] = tensor
        elif isinstance(part, tuple):
            experts.setdefault(ours, {}).setdefault(part[1], {})[part[2]] = tensor
        elif isinstance(part, str):
            out[ours] = layouts[part][0](tensor).contiguous()
        else:
            parts.setdefault(ours, {})[part] = tensor
    for ours, pieces in parts.items():
        out[ours] = torch.cat([pieces[k] for k in sorted(pieces)], dim=0)
    for ours, by_expert in experts.items():
        out[ours] = torch.stack([torch.cat([p[k] for k in sorted(p, key=lambda x: x or 0)], dim=0)
                                 for _, p in sorted(by_expert.items())])
    return out


def to_hf(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's weights under HF names (fused tensors split back), contiguous, detached."""
    config: ModelConfig = model.config
    ours = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    layouts = _layouts(config)
    for hf_name in hf_shapes(config, {k: v.shape for k, v in ours.items()}):
        name, part = map_name(hf_name, config)  # type: ignore[misc]
        tensor = ours[name].detach()
        if isinstance(part, tuple):
            tensor = tensor[part[1]]
            if part[2] is not None:
                tensor = tensor.split(_part_sizes(config, name), dim=0)[part[2]]
        elif isinstance(part, str):
            tensor = layouts[part][1](tensor)
        elif part is not None:
            tensor = tensor.split(_part_sizes(config, name), dim=0)[part]
        out[hf_name] = tensor.contiguous().clone()
    return out
