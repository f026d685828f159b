"""Write a trained model as a Hugging Face Llama checkpoint directory.

Design: the embedded model is stored exactly like any model a user downloads
(config.json with `LlamaForCausalLM`, model.safetensors under transformers' tensor names,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json), so
the server loads it through the same loader and nothing special-cases it. Tensor names
come from `workers.model.weights.to_hf`, the inverse of the loader's one HF -> ours map (it
splits our fused `wqkv` and `w_gate_up` back into q/k/v and gate/up).
Trade-off: weights are stored in bf16 (half the bytes in git; the loader's `auto` dtype
runs bf16 on CPU anyway), so fp32 training results move by bf16 rounding.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from workers.model.config import ModelConfig
from workers.model.weights import to_hf

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")

# Messages -> prompt. Each turn is `<|role|>\n{content}<|eos|>`; a generation prompt ends
# with `<|assistant|>\n`. No bos_token here: the tokenizer's post-processor adds it when a
# prompt is encoded (as for plain completions), so a prompt never carries two.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "max_new_tokens": 64}


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template rendered the way transformers renders it (sandboxed Jinja)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def tokenizer_config(tokenizer: Tokenizer, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json as transformers' PreTrainedTokenizerFast reads it."""
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def write_checkpoint(
    out_dir: Path, model: torch.nn.Module, config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype
) -> int:
    """Write config, weights, tokenizer and generation config; returns the weights' bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    tensors = {k: v.to(dtype).contiguous() for k, v in to_hf(model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # save_file creates it 0600
    hf_config = replace(config, torch_dtype=dtype_name).to_hf_config()
    hf_config.update({"torch_dtype": dtype_name, "pad_token_id": tokenizer.token_to_id(PAD), "use_cache": True})
    _write_json(out_dir / "config.json", hf_config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer, config.max_position_embeddings))
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    generation = {
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "pad_token_id": tokenizer.token_to_id(PAD),
        **GENERATION_DEFAULTS,
    }
    _write_json(out_dir / "generation_config.json", generation)
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('""""""\n')
    return (out_dir / "model.safetensors").stat().st_size


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
