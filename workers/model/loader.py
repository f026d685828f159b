"""Load a Hugging Face model directory into a `Transformer`, its tokenizer and templates.

Design: everything a worker needs from a checkpoint comes back in one frozen
`LoadedModel`; every failure is a `ModelLoadError` that names the file, architecture or
tensor at fault (and what was expected), so a worker's "failed at load" status tells the
operator what to fix. Weights are read tensor by tensor through `safetensors.safe_open`,
checked against the shapes the config implies, converted to the chosen dtype and assigned
into a meta-built model (no double allocation). The dtype choice returns its reason. A
pre-quantized checkpoint is read through `workers.quant` (its registry picks the reader; the loader
hands it the family's weight map as a `ModelMap` and names the device the layers are laid out for).
A GGUF file is first prepared as a directory (workers/gguf/: config and tokenizer converted once)
whose tensors are read from the GGUF files under the same Hugging Face names: dequantized, or kept
as their blocks in GGUF layers on a device whose GGUF rule keeps them packed (workers/gguf/packed.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from workers.contract import DEFAULT_MODEL_DIR, find_chat_template, token_text
from workers.contract.dtypes import DtypeError, dtype_rule
from workers.gguf.files import GGUFError, is_gguf
from workers.gguf.packed import PackedGGUF, packed_gguf
from workers.gguf.prepare import pointed_files, prepare
from workers.gguf.weights import gguf_tensors
from workers.model.config import ConfigError, ModelConfig
from workers.model.moe import FusedMoE
from workers.model.transformer import Transformer
from workers.model.weights import IGNORED_HF, hf_shapes, map_name, skipped, text_name, to_ours
from workers.quant.checkpoint import ModelMap
from workers.quant.registry import CheckpointReader, quantized_checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelLoadError(ValueError):
    """A model directory that cannot be served; the message says what is wrong and where."""


@dataclass(frozen=True, eq=False)
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Any  # tokenizers.Tokenizer
    generation_config: dict
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    dtype_reason: str
    model_dir: Path
    model_id: str
    quantization: dict | None = None  # a pre-quantized checkpoint's method and schemes (workers/quant/registry.py)


# ---- dtype ----------------------------------------------------------------------------
def choose_dtype(
    requested: str, checkpoint_dtype: str | None, device_type: str, capability: tuple[int, int] | None = None
) -> tuple[torch.dtype, str]:
    """(dtype, reason): the contract's rule (`workers.contract.dtypes.dtype_rule`) as a torch dtype."""
    try:
        name, reason = dtype_rule(requested, checkpoint_dtype, device_type, capability)
    except DtypeError as e:
        raise ModelLoadError(str(e)) from e
    return DTYPES[name], reason


# ---- files ------------------------------------------------------------------------------
def _read_json(model_dir: Path, name: str, required: bool) -> dict:
    path = model_dir / name
    if not path.is_file():
        if required:
            raise ModelLoadError(f"Missing `{name}` in model directory `{model_dir}`")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"`{name}` in `{model_dir}` is not valid JSON: {e}") from e


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(model_dir, index.name, required=True).get("weight_map", {})
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"Missing `{f.name}` (listed in `{index.name}`) in model directory `{model_dir}`")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"Missing `model.safetensors` (or `model.safetensors.index.json`) in model directory `{model_dir}`"
    )


def _load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"Missing `tokenizer.json` in model directory `{model_dir}`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise ModelLoadError(f"`tokenizer.json` in `{model_dir}` could not be read: {e}") from e


# ---- weights ------------------------------------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _other_stage(name: str, stage: tuple[int, int], expected: dict) -> bool:
    """Whether checkpoint tensor `name` belongs to another pipeline stage than `stage` [start, end):
    a layer outside it, or the embedding, final norm or head that this stage does not hold."""
    m = _LAYER.search(name)
    return not stage[0] <= int(m.group(1)) < stage[1] if m else name not in expected


def _model_map(config: ModelConfig) -> ModelMap:
    """The family's weight map and experts layer, as a quantized checkpoint's reader takes them."""
    return ModelMap(config.architecture, config.num_experts, partial(map_name, config=config),
                    partial(to_ours, config=config), FusedMoE)


def _stored_tensors(model_dir: Path, config: ModelConfig, expected: dict, packed=None) -> Iterator[tuple]:
    """(file name, stored name, HF name, shape, read) of each tensor of the checkpoint: its safetensors
    files', or the GGUF files' a prepared GGUF directory stands for (workers/gguf/), dequantized but for
    those `packed` names (read as their blocks)."""
    from safetensors import safe_open

    files = pointed_files(model_dir)
    if files is not None:
        try:
            yield from gguf_tensors(files, expected, config.num_attention_heads, config.num_key_value_heads, packed)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from e
        return
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                # a multimodal checkpoint's text model, as a text checkpoint names it
                yield (path.name, stored, text_name(stored), tuple(f.get_slice(stored).get_shape()),
                       partial(f.get_tensor, stored))


def _read_weights(model_dir: Path, model: Transformer, dtype: torch.dtype, device: str,
                  quant: CheckpointReader | PackedGGUF | None = None) -> dict[str, torch.Tensor]:
    config = model.config
    expected = hf_shapes(config, {k: v.shape for k, v in model.state_dict().items()})
    if quant is not None:
        quant.bind(model, expected)
    found: dict[str, torch.Tensor] = {}
    as_stored: dict[str, torch.Tensor] = {}  # a quantized layer's bytes and scales, never converted
    unexpected: list[str] = []
    skips: dict[str, int] = {}  # pattern of the family's `skipped` tensors -> how many
    packed = quant.claims if isinstance(quant, PackedGGUF) else None
    for file, stored, name, shape, read in _stored_tensors(model_dir, config, expected, packed):
        if IGNORED_HF.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if model.stage is not None and _other_stage(name, model.stage, expected):
            continue  # another stage's layer (workers/pipeline/)
        if (pattern := skipped(name, config)) is not None:
            skips[pattern] = skips.get(pattern, 0) + 1
            continue
        if quant is not None and quant.claims(name):
            as_stored[name] = read().to(device=device)
            continue
        if name not in expected or map_name(name, config) is None:
            unexpected.append(name)
            continue
        if shape != expected[name]:
            raise ModelLoadError(
                f"Tensor `{stored}` in `{file}` has shape {shape}; the config expects {expected[name]}")
        found[name] = read().to(device=device, dtype=dtype)
    for pattern, count in skips.items():  # a vision tower, a multi-token prediction head: not the text model
        logger.info("Skipped %d tensors matching `%s`: not part of the text model served", count, pattern)
    missing = [n for n in expected if n not in found and n not in as_stored
               and not (quant is not None and quant.covers(n))]  # a 4-bit layer's weight, made from its tensors
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {', '.join(f'`{n}`' for n in missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected tensors {', '.join(f'`{n}`' for n in unexpected[:8])}"
                         + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))
        raise ModelLoadError(f"Checkpoint in `{model_dir}` does not match its config: {'; '.join(parts)}")
    return to_ours(found, config) | ({} if quant is None else quant.to_ours(as_stored))


# ---- entry point ----------------------------------------------------------------------------
def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    capability: tuple[int, int] | None = None,
    stage: tuple[int, int] | None = None,
    device_type: str | None = None,
) -> LoadedModel:
    """Load config, weights, tokenizer, generation config and chat template from `model_dir`;
    with `stage` (layers [start, end) of a pipeline), only that stage's weights. A quantized
    checkpoint's layers are laid out for the device `device_type` at `capability` (the worker's bound
    device: a simulated GPU loads onto the CPU yet keeps its GPU's execution); `device_type` defaults
    to `device`'s own type."""
    model_dir = Path(model_dir).expanduser().resolve()
    device = torch.device(device)
    if is_gguf(model_dir):  # a GGUF file, split part or directory: its converted directory (workers/gguf/)
        try:
            model_dir = prepare(model_dir)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from e
    if model_dir == DEFAULT_MODEL_DIR and not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"The embedded model is absent: `config.json` not found in `{model_dir}`; pass a model directory"
        )
    if not model_dir.is_dir():
        raise ModelLoadError(f"Model directory `{model_dir}` does not exist")
    hf_config = _read_json(model_dir, "config.json", required=True)
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except ConfigError as e:
        raise ModelLoadError(f"{e} (in `{model_dir / 'config.json'}`)") from e
    except KeyError as e:
        raise ModelLoadError(f"`config.json` in `{model_dir}` lacks the field `{e.args[0]}`") from e
    torch_dtype, reason = choose_dtype(dtype, config.torch_dtype, device.type, capability)
    quant = quantized_checkpoint(hf_config, _model_map(config), device_type or device.type,
                                 capability)  # None unless config.json has a quantization_config
    # a GGUF file on a device that keeps its blocks packed (workers/gguf/execution.py `gguf_rule`)
    reader = quant or packed_gguf(pointed_files(model_dir), partial(map_name, config=config),
                                  device_type or device.type, capability)
    tokenizer = _load_tokenizer(model_dir)
    tok_cfg = _read_json(model_dir, "tokenizer_config.json", required=False)
    generation_config = _read_json(model_dir, "generation_config.json", required=False)
    model = Transformer.from_config(config, torch_dtype)
    if stage is not None:  # a pipeline stage (workers/pipeline/): its layers only
        try:
            model.keep_stage(*stage)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    try:
        state_dict = _read_weights(model_dir, model, torch_dtype, str(device), reader)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from e
    if reader is not None:
        reader.install(model, state_dict)  # fp8 layers as stored (the fp8 step prepares them); GGUF blocks
    model.load_weights(state_dict)
    model.eval()
    bos_token = token_text(tok_cfg.get("bos_token"))
    eos_token = token_text(tok_cfg.get("eos_token"))
    template = find_chat_template(model_dir, tok_cfg)
    eos_ids = _eos_ids(generation_config, config, tokenizer, eos_token)
    model_id = hf_config.get("_name_or_path") or _gguf_name(model_dir) or model_dir.name
    logger.info("Loaded %s (%s, %s params) as %s: %s", model_id, config.architecture, config.num_parameters,
                torch_dtype, reason)
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, generation_config=generation_config,
        chat_template=None if template is None else template.source, bos_token=bos_token, eos_token=eos_token,
        eos_token_ids=eos_ids, dtype=torch_dtype, dtype_reason=reason, model_dir=model_dir, model_id=str(model_id),
        quantization=None if quant is None else quant.describe(),
    )


def _gguf_name(model_dir: Path) -> str | None:
    """A prepared GGUF directory's model name (its file's stem), not its cache key."""
    pointer = model_dir / "gguf.json"
    return json.loads(pointer.read_text()).get("name") if pointer.is_file() else None


# Tokens that end an answer in a family's own chat format, whatever generation_config.json lists:
# gpt-oss's harmony format ends a final answer with <|return|> and a tool call with <|call|>.
FORMAT_STOP_TOKENS = {"gpt_oss": ("<|return|>", "<|call|>")}


def _eos_ids(generation_config: dict, config: ModelConfig, tokenizer, eos_token: str | None) -> tuple[int, ...]:
    """Union, in order: generation_config's eos ids, config.json's, the tokenizer's eos token, and
    the family's format stop tokens the tokenizer has (`FORMAT_STOP_TOKENS`)."""
    ids: list[int] = []
    gen = generation_config.get("eos_token_id")
    ids.extend([gen] if isinstance(gen, int) else list(gen or []))
    ids.extend(config.eos_token_id)
    for token in (eos_token, *FORMAT_STOP_TOKENS.get(config.architecture, ())):
        if token is not None and tokenizer.token_to_id(token) is not None:
            ids.append(tokenizer.token_to_id(token))
    return tuple(dict.fromkeys(int(i) for i in ids))
