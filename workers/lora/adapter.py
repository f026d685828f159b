"""One LoRA adapter as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`), read
onto our fused layers.

Design: PEFT names each low-rank pair after the Hugging Face module it wraps
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` [r, in], `lora_B.weight`
[out, r]); the family's one weight map (workers/model/weights.py) turns that module into ours and
the part of it (`q_proj` is part 0 of `wqkv`), so an adapter lands on the rows of a fused output
that its module owns: `out[:, offset:offset + size] += scale * (x @ A^T) @ B^T`. The scale is
PEFT's `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`. Everything is checked at
load: a module we cannot target, a rank above the worker's limit, shapes of another base, or a
PEFT option that changes the computation (DoRA, per-module rank or alpha patterns, trained
biases, saved full modules) is a `LoraError` naming it and what is accepted. Trade-off: the
pairs stay unmerged (each step pays two thin matmuls per targeted projection and adapter) so one
base serves many adapters at once; a merged copy would be free per step but one model per adapter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.lora.experts import ExpertLora, check_target_parameters, read_experts
from workers.model.config import ModelConfig
from workers.model.weights import _part_sizes, map_name

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's (Hugging Face) module names we take, and the layer of ours each lands on
TARGETS = {"q_proj": "wqkv", "k_proj": "wqkv", "v_proj": "wqkv", "o_proj": "wo", "gate_proj": "w_gate_up",
           "up_proj": "w_gate_up", "down_proj": "w_down"}
PREFIX = "base_model.model."
# PEFT options that change what the adapter computes, with the value that means "off"
_OFF = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
        "modules_to_save": (None, [], ()), "bias": ("none",), "lora_bias": (False, None), "fan_in_fan_out": (False,),
        "layer_replication": (None, []), "trainable_token_indices": (None, [], {}),
        "use_qalora": (False, None)}


def is_projection(module: torch.nn.Module) -> bool:
    """A layer `y = x W^T (+ b)` whatever its weights' storage (`nn.Linear`, fp8, int4 or GGUF blocks):
    what a pair's product can be added after (its `in_features` and `out_features` are ints)."""
    return all(isinstance(getattr(module, f, None), int) for f in ("in_features", "out_features"))


class LoraError(ValueError):
    """An adapter that does not fit this worker's base model or limits (a 4xx at load)."""


@dataclass(frozen=True, eq=False)
class LoraTarget:
    """One low-rank pair on one of our projections: rows `offset:offset + size` of its output."""

    offset: int
    size: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [size, r]


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """An adapter read and checked: our module name -> its pairs, and the scale they share."""

    name: str
    path: Path
    rank: int
    alpha: float
    rslora: bool
    scale: float
    targets: dict[str, tuple[LoraTarget, ...]]
    identity: str = ""  # the files it was read from (path, size, mtime): a reloaded name is another adapter
    base: str | None = None  # `base_model_name_or_path` as PEFT recorded it (informational)
    slot: int | None = None  # its slot in the worker's pool (workers/lora/pool.py); None: read, not placed
    experts: dict[str, ExpertLora] = field(default_factory=dict)  # our FusedMoE name -> its pairs (experts.py)

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for pairs in self.targets.values() for t in pairs) + \
            sum(x.nbytes for x in self.experts.values())


def read_config(path: Path) -> dict:
    """`adapter_config.json` of `path`, checked for options we compute as PEFT does."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter `{path}` has no `{CONFIG_FILE}` (a PEFT adapter directory holds "
                        f"`{CONFIG_FILE}` and `{WEIGHTS_FILE}`)")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"LoRA adapter `{path}`: `{CONFIG_FILE}` is not JSON ({e})") from None
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter `{path}` is of PEFT type `{peft_type}`. Accepted: `LORA`")
    for key, off in _OFF.items():
        if key in cfg and cfg[key] not in off:
            raise LoraError(f"LoRA adapter `{path}` sets `{key}` = `{cfg[key]}`, which this server does not "
                            f"compute. Accepted: `{key}` = `{off[0]}` (plain LoRA, optionally rsLoRA)")
    check_target_parameters(path, cfg.get("target_parameters"))
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), int | float) or cfg[key] <= 0:
            raise LoraError(f"LoRA adapter `{path}`: `{key}` must be a positive number, got `{cfg.get(key)}`")
    return cfg


def read_adapter(name: str, path: str | Path, config: ModelConfig, model: torch.nn.Module, max_rank: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> LoraAdapter:
    """Read the PEFT adapter in `path` for `model` (built for `config`), as `dtype` on `device`."""
    from safetensors.torch import load_file

    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise LoraError(f"LoRA adapter directory `{path}` does not exist")
    cfg = read_config(path)
    rank, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    if rank > max_rank:
        raise LoraError(f"LoRA adapter `{name}` has rank `{rank}`, above this worker's `--max-lora-rank` "
                        f"{max_rank}. Accepted: ranks 1..{max_rank}")
    if not (path / WEIGHTS_FILE).is_file():
        raise LoraError(f"LoRA adapter `{path}` has no `{WEIGHTS_FILE}` (PEFT's `save_pretrained` writes it)")
    tensors = load_file(str(path / WEIGHTS_FILE))
    pairs = _pairs(name, tensors)
    experts = read_experts(name, pairs, model, config.architecture, dtype, device)  # taken out of `pairs`
    modules = dict(model.named_modules())
    targets: dict[str, list[LoraTarget]] = {}
    for module_name, (a, b) in sorted(pairs.items()):
        ours, offset, size = _locate(name, module_name, config)
        layer = modules.get(ours)
        if layer is None or not is_projection(layer):
            raise LoraError(f"LoRA adapter `{name}` targets `{module_name}`, which this base model does not have "
                            f"({config.num_hidden_layers} layers): an adapter of another base")
        size = layer.out_features if size < 0 else size
        want_a, want_b = (a.shape[0], layer.in_features), (size, a.shape[0])
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b or a.shape[0] != rank:
            raise LoraError(f"LoRA adapter `{name}`: `{module_name}` has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"this base model takes A ({rank}, {layer.in_features}) and B ({size}, {rank}) there: "
                            f"an adapter of another base (or of another rank than its `r`)")
        targets.setdefault(ours, []).append(LoraTarget(offset, size, a.to(device, dtype), b.to(device, dtype)))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    stat = (path / WEIGHTS_FILE).stat()
    ordered = {k: tuple(sorted(v, key=lambda t: t.offset)) for k, v in targets.items()}
    return LoraAdapter(name, path, rank, alpha, rslora, scale, ordered,
                       f"{path}:{stat.st_size}:{stat.st_mtime_ns}", cfg.get("base_model_name_or_path"), None, experts)


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's module name -> (A, B); any other tensor (an embedding's pair, a saved module) refused."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(PREFIX)
        if stem.endswith(".base_layer.weight") and stem.split(".")[-3] not in TARGETS:
            continue  # the copy PEFT saves of a targeted LM head or embedding: refused by module below
        for part in ("lora_A", "lora_B"):
            if stem.endswith(f".{part}.weight"):
                found.setdefault(stem[: -len(f".{part}.weight")], {})[part] = tensor
                break
        else:
            raise LoraError(f"LoRA adapter `{name}` holds the tensor `{key}`, which this server does not apply. "
                            f"Accepted: `lora_A` / `lora_B` weights of {', '.join(TARGETS)}")
    if not found:
        raise LoraError(f"LoRA adapter `{name}` holds no `lora_A` / `lora_B` weights")
    incomplete = sorted(m for m, p in found.items() if len(p) != 2)
    if incomplete:
        raise LoraError(f"LoRA adapter `{name}` has `{incomplete[0]}` without both `lora_A` and `lora_B`")
    return {m: (p["lora_A"], p["lora_B"]) for m, p in found.items()}


def _locate(name: str, module_name: str, config: ModelConfig) -> tuple[str, int, int]:
    """PEFT's module -> (our module, offset and size of its rows in our fused output)."""
    leaf = module_name.rsplit(".", 1)[-1]
    mapped = map_name(f"{module_name}.weight", config) if leaf in TARGETS else None
    if mapped is None or isinstance(mapped[1], tuple | str) or not mapped[0].endswith(f".{TARGETS[leaf]}.weight"):
        raise LoraError(f"LoRA adapter `{name}` targets `{module_name}`, which this server cannot apply to a "
                        f"`{config.architecture}` model. Accepted target modules: {', '.join(TARGETS)} "
                        f"(attention and dense MLP projections, and experts through `target_parameters`; "
                        f"not embeddings or the LM head)")
    ours, part = mapped
    ours = ours.removesuffix(".weight")
    if part is None:
        return ours, 0, -1  # the whole output; the size is checked against the layer below
    sizes = _part_sizes(config, f"{ours}.weight")
    return ours, sum(sizes[:part]), sizes[part]
