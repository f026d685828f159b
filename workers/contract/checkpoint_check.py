"""Can this checkpoint be served? Decided once from its config.json, in the router, before any worker starts.

Design: the torch-free part of the workers' registries lives here and the workers import it back:
the Hugging Face names of every architecture family (workers/model/families/registry.py checks its
families against `ARCHITECTURES`), the rope types (workers/model/rope.py), the layer types and
activations (workers/model/families/base.py) and the quantization methods (workers/quant/registry.py).
`check_config(hf)` refuses what those tables refuse, with a `CheckpointError` of one line that names
the bad value and lists what is supported; `hetserve serve` and `hetserve plan --model` turn it into
a usage error (exit 2) before binding the port. Trade-off: only what a table decides is checked
here; what a family's `read` computes from sizes (head counts, shapes) is still refused at the
worker's `load`, once, with its reason (workers/main.py), since repeating that arithmetic here
would be a second copy of the families.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# family (our name, `ModelConfig.architecture`) -> (config.json `architectures[0]`, `model_type`)
ARCHITECTURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("LlamaForCausalLM",), ("llama",)),
    "mistral": (("MistralForCausalLM",), ("mistral",)),
    "qwen2": (("Qwen2ForCausalLM",), ("qwen2",)),
    "qwen3": (("Qwen3ForCausalLM",), ("qwen3",)),
    "gemma2": (("Gemma2ForCausalLM",), ("gemma2",)),
    "gemma3": (("Gemma3ForCausalLM",), ("gemma3_text",)),
    "phi3": (("Phi3ForCausalLM",), ("phi3",)),
    "smollm3": (("SmolLM3ForCausalLM",), ("smollm3",)),
    "olmo2": (("Olmo2ForCausalLM",), ("olmo2",)),
    "olmo3": (("Olmo3ForCausalLM",), ("olmo3",)),
    "granite": (("GraniteForCausalLM",), ("granite",)),
    "qwen3_moe": (("Qwen3MoeForCausalLM",), ("qwen3_moe",)),
    "mixtral": (("MixtralForCausalLM",), ("mixtral",)),
    "gpt_oss": (("GptOssForCausalLM",), ("gpt_oss",)),
    "qwen3_5": (("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), ("qwen3_5_text", "qwen3_5")),
    "qwen3_5_moe": (("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                    ("qwen3_5_moe_text", "qwen3_5_moe")),
    "qwen3_next": (("Qwen3NextForCausalLM",), ("qwen3_next",)),
    "gemma4": (("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), ("gemma4_text", "gemma4")),
}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
FULL, SLIDING = "full_attention", "sliding_attention"
LINEAR = "linear_attention"  # a Gated DeltaNet layer: a recurrent state, no KV
LAYER_TYPES = (FULL, SLIDING)
# config.json `hidden_act` / `hidden_activation` -> ours
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# `quantization_config.quant_method`: fp8 (compressed-tensors float-quantized, block-wise fp8), 4-bit and MXFP4
QUANT_METHODS = ("awq", "compressed-tensors", "fp8", "gptq", "mxfp4")
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint this server cannot serve; one line naming what and listing what is supported."""


def supported_architectures() -> list[str]:
    return sorted(n for names, _ in ARCHITECTURES.values() for n in names)


def _family(hf: dict[str, Any]) -> str:
    by_name = {n: fam for fam, (archs, types) in ARCHITECTURES.items() for n in (*archs, *types)}
    for name in [*(hf.get("architectures") or []), hf.get("model_type")]:
        if name in by_name:
            return by_name[name]
    shown = (hf.get("architectures") or [None])[0] or hf.get("model_type")
    raise CheckpointError(f"Unsupported architecture `{shown}`. Supported: {', '.join(supported_architectures())}")


def _rope_sets(hf: dict[str, Any]) -> list[dict]:
    """The rope parameter sets the workers compute, merged as workers/model/families/base.py
    `rope_fields` merges them: transformers 4's `rope_scaling` under transformers 5's
    `rope_parameters` (flat, or one set per layer type)."""
    params = hf.get("rope_parameters")
    legacy = hf.get("rope_scaling") if isinstance(hf.get("rope_scaling"), dict) else {}
    if isinstance(params, dict) and set(params) & {FULL, SLIDING}:
        full, sliding = params.get(FULL), params.get(SLIDING)
        return [{**legacy, **(full if isinstance(full, dict) else {})},
                *([sliding] if isinstance(sliding, dict) else [])]
    return [{**legacy, **(params if isinstance(params, dict) else {})}]


def check_config(hf: dict[str, Any]) -> str:
    """The checkpoint's family when its tables allow it; `CheckpointError` (one line) otherwise."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{CONFIG_FILE} must hold a JSON object, got `{type(hf).__name__}`")
    family = _family(hf)
    text = hf.get("text_config")
    text = {**hf, **text} if isinstance(text, dict) else hf  # a multimodal checkpoint: its text model
    for params in _rope_sets(text):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"Unsupported rope type `{rope_type}`. Supported: {', '.join(ROPE_TYPES)}")
    allowed = (*LAYER_TYPES, LINEAR)
    for t in text.get("layer_types") or ():
        if t not in allowed:
            raise CheckpointError(f"Unsupported layer type `{t}` in `layer_types`. Supported: {', '.join(allowed)}")
    for key in ("hidden_act", "hidden_activation"):
        act = text.get(key)
        if act is not None and act not in HF_ACTIVATIONS:
            raise CheckpointError(f"Unsupported `{key}` `{act}`. Supported: {', '.join(sorted(HF_ACTIVATIONS))}")
    qc = hf.get("quantization_config")
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        if method not in QUANT_METHODS:
            raise CheckpointError(f"Unsupported quantization method `{method}`. Supported: {', '.join(QUANT_METHODS)}")
    return family


def check_checkpoint(model_dir: str | Path) -> str:
    """`check_config` of `model_dir`'s config.json; a missing or unreadable one is a `CheckpointError` too."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"`{model_dir}` has no {CONFIG_FILE}; pass a Hugging Face model directory") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"`{path}` cannot be read as JSON: {e}") from e
    return check_config(hf)
