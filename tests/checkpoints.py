"""Small random checkpoints in Hugging Face layout, for tests.

`make_checkpoint(path, **overrides)` writes config.json, model.safetensors (or shards plus
model.safetensors.index.json), tokenizer.json (a byte-level BPE trained on a few
sentences, padded with `<|extra_N|>` tokens so every id decodes), tokenizer_config.json
with a chat template, and generation_config.json. The weights are drawn directly under
Hugging Face names from the config, independent of our model code, so a loading or
mapping mistake on our side shows up as a parity failure against transformers.

    from tests.checkpoints import make_checkpoint
    ckpt = make_checkpoint(tmp_path / "m", arch="qwen2", num_key_value_heads=1)

`save_hf_checkpoint(model, dir)` writes one of our models back in that layout (its weights
through the family's one HF map, `workers.model.weights.to_hf`); `default_model_dir()` is the
embedded checkpoint a worker serves without `--model`.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.contract import DEFAULT_MODEL_DIR
from workers.model.weights import to_hf

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny model used in tests.",
    "A heterogeneous host has GPUs of different architectures.",
    "Each worker binds one device, picks its kernels and its fp8 convention.",
    "Once upon a time there was a little language model that could.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: + - * / = < > ( ) [ ] { }",
    "user assistant system: What is the capital of France? Paris is the capital of France.",
]

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False},
}
TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE with `<s>`=0, `</s>`=1, `<pad>`=2, exactly `vocab_size` ids, as JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"`vocab_size` {vocab_size} is below the byte alphabet plus specials ({tok.get_vocab_size()})")
    # Pad so every id the model can emit decodes to text.
    tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 0)])
    return tok.to_str()


def _hf_config(arch: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"Unknown arch `{arch}`. Supported: {', '.join(ARCH_DEFAULTS)}")
    cfg = {**ARCH_DEFAULTS[arch], **TINY, **overrides}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    cfg["rope_parameters"] = rope  # transformers 5 spelling; rope_theta/rope_scaling kept for v4
    return cfg


def _tensors(cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights under HF names; scales chosen so greedy decoding has clear margins."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def mat(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * (gain / math.sqrt(cols))

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen), "model.norm.weight": norm()}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = mat(nh * d, h, 2.0)
        out[p + "self_attn.k_proj.weight"] = mat(nkv * d, h, 2.0)
        out[p + "self_attn.v_proj.weight"] = mat(nkv * d, h)
        out[p + "self_attn.o_proj.weight"] = mat(h, nh * d, 0.5)
        if bias:
            for name, n in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
                out[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n, generator=gen)
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = mat(i, h)
        out[p + "mlp.up_proj.weight"] = mat(i, h)
        out[p + "mlp.down_proj.weight"] = mat(h, i, 0.5)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = mat(v, h, 4.0)
    return {k: t.to(dtype).contiguous() for k, t in out.items()}


def make_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    shards: int = 1,
    generation_config: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random `arch` ("llama" | "mistral" | "qwen2") checkpoint into `path`.

    `config_overrides` are config.json keys (e.g. `num_key_value_heads=1`,
    `tie_word_embeddings=True`, `rope_scaling=LLAMA3_ROPE`, `torch_dtype="bfloat16"`,
    `vocab_size=4096`). Weights are stored in `torch_dtype`. `shards > 1` writes
    `model-0000k-of-0000n.safetensors` files with an index.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _hf_config(arch, config_overrides)
    dtype = getattr(torch, cfg["torch_dtype"])
    tensors = _tensors(cfg, seed, dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(tensors)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "tokenizer.json").write_text(tokenizer_json(cfg["vocab_size"]))
    tok_cfg = {
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
        "model_max_length": cfg["max_position_embeddings"], "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", **(tokenizer_config or {}),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], **(generation_config or {})}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    return path


def default_model_dir() -> Path:
    """The embedded checkpoint served when no `--model` is given (workers/default_model/)."""
    return DEFAULT_MODEL_DIR


def save_hf_checkpoint(model: torch.nn.Module, out_dir, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors` (HF names) for `model` into `out_dir`.

    Tokenizer files are the caller's; `workers.model.loader.load_model` reads the result back and
    so does transformers' `LlamaForCausalLM.from_pretrained`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    saved_dtype = next(iter(tensors.values())).dtype
    config = replace(model.config, torch_dtype=str(saved_dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
