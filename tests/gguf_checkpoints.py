"""Tiny random GGUF files written by gguf-py's own `GGUFWriter`, as llama.cpp's converter lays them out.

A case is a family and a tensor type: transformers builds the model at random (dims like the
embedded model's, 2 layers), and each tensor is written under its GGUF name (gguf-py's
`TensorNameMap`), Llama's q/k rows interleaved as llama.cpp's converter does, matrices quantized
by gguf-py's quantizers (norms and biases stay F32, as llama.cpp keeps them); the type "mixed"
gives every matrix another type, the K- and IQ-types as random blocks (`MIXED`), "Q4_K_M" mixes
Q4_K, Q6_K and Q8_0 so (a fused q/k/v of two types among them), with the embedded
model's tokenizer as `tokenizer.ggml.*` keys and its chat template. Files are written into the
directory the caller gives (a tmp dir); nothing is downloaded or committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from workers.contract import DEFAULT_MODEL_DIR

VOCAB = 4096
DIMS = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.05)
# GGUF architecture -> (transformers model_type, options)
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),  # q/k/v and gate/up fused in the file as in the checkpoint
    # Gemma: a head of 256 (the scale transformers' GGUF reader leaves at its default), a window shorter than
    # the prompts; Gemma 3 with 6 layers, so that one is global
    "gemma2": ("gemma2", dict(head_dim=256, sliding_window=8, initializer_range=0.02)),
    "gemma3": ("gemma3_text", dict(head_dim=256, sliding_window=8, num_hidden_layers=6, initializer_range=0.02)),
    # Mixtral: llama.cpp writes it as `llama` with experts (transformers' GGUF reader makes a Llama of it,
    # so its reference is the transformers model the file was written from: `reference_model`)
    "mixtral": ("mixtral", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    # OLMo 2 and Granite, which transformers' GGUF reader does not read: the same reference
    "olmo2": ("olmo2", dict(tie_word_embeddings=False)),
    "granite": ("granite", dict(tie_word_embeddings=True, attention_multiplier=0.1, embedding_multiplier=2.0,
                                residual_multiplier=0.5, logits_scaling=4.0)),
    # transformers' GGUF reader leaves Qwen3's head_dim at its default (128) whatever `key_length` says:
    # a head wider than hidden/heads, as real Qwen3 checkpoints have
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, head_dim=128)),
    # and Qwen3-MoE's moe_intermediate_size at its default (768, Qwen3-30B-A3B's) whatever the file says
    "qwen3moe": ("qwen3_moe", dict(tie_word_embeddings=False, head_dim=128, num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=768, norm_topk_prob=True)),
}


# "mixed": one file of many types, as Q4_K_M mixes Q4_K and Q6_K; a matrix's type by its position.
# The K- and IQ-types, which gguf-py cannot quantize, are random blocks with small fp16 scales
# (offsets of each block's fp16 scales below): values both dequantizers read alike.
MIXED = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q8_0", "Q5_0", "Q5_1", "Q4_1", "Q4_0", "BF16",
         "F16", "MXFP4")
# "Q4_K_M": llama.cpp's most used mix, a matrix's type by its position among these three
Q4_K_M = ("Q4_K", "Q6_K", "Q8_0")
FP16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
               "IQ4_XS": (0,)}


def _random_blocks(gguf, kind, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random `kind` blocks for a tensor of `shape`, each fp16 scale small (about 1e-4) and finite."""
    elements, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // elements, size), dtype=np.uint8)
    for offset in FP16_SCALES[kind.name]:
        scales = (rng.choice([-1, 1], size=raw.shape[:-1]) * rng.uniform(2e-5, 2e-4, size=raw.shape[:-1]))
        raw[..., offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(*shape[:-1], -1)


def _add(writer, gguf, name: str, data: np.ndarray, qtype: str, index: int, rng: np.random.Generator) -> None:
    """Write one tensor as `qtype` (in "mixed", the type of its position) where its rows are whole
    blocks; norms, biases and rows of another length stay F32, as llama.cpp keeps them."""
    if qtype == "mixed":
        qtype = MIXED[index % len(MIXED)]
    elif qtype == "Q4_K_M":
        qtype = Q4_K_M[index % len(Q4_K_M)]
    kind = gguf.GGMLQuantizationType[qtype]
    if data.ndim < 2 or qtype == "F32" or data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        writer.add_tensor(name, data)
    elif qtype == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in FP16_SCALES:
        writer.add_tensor(name, _random_blocks(gguf, kind, data.shape, rng), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


GGUF_ARCH = {"mixtral": "llama"}  # our case name -> the file's `general.architecture`, where they differ
IN_MEMORY_REFERENCE = ("granite", "mixtral", "olmo2")  # compared with `reference_model`, not transformers' GGUF load


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer) -> None:
    tok = json.loads((DEFAULT_MODEL_DIR / "tokenizer.json").read_text())
    cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    for a in tok["added_tokens"]:
        vocab[a["id"]] = a["content"]
    tokens = [vocab[i] for i in range(VOCAB)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(VOCAB)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(cfg["chat_template"])


def _gguf_tensors(model, cfg, names):
    """(GGUF name, float32 array) of each tensor, as llama.cpp's converter names them; transformers'
    fused experts [E, 2I, H] (gate then up) become GGUF's stacked `ffn_gate_exps` and `ffn_up_exps`."""
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if hf_name.endswith("experts.gate_up_proj"):
            base = hf_name.removesuffix("gate_up_proj")
            gate, up = np.split(data, 2, axis=1)
            yield names.get_name(base + "gate_proj") + ".weight", np.ascontiguousarray(gate)
            yield names.get_name(base + "up_proj") + ".weight", np.ascontiguousarray(up)
        elif hf_name.endswith("experts.down_proj"):
            yield names.get_name(hf_name) + ".weight", data
        else:
            base, suffix = hf_name.rsplit(".", 1)
            yield names.get_name(base) + "." + suffix, data


def reference_model(arch: str, seed: int = 0, options: dict | None = None):
    """The transformers model (fp32, eval) that `make_gguf(arch, ..., seed, options=options)` writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, family = FAMILIES[arch]
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**DIMS, **family, **(options or {})})
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def _rope_freqs(rope: dict, dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as `rope_freqs.weight` for a Llama 3 rope scaling."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def make_gguf(arch: str, qtype: str, out: Path, seed: int = 0, split_tensors: int = 0,
              options: dict | None = None) -> Path:
    """Write `out/<arch>-<qtype>.gguf` and return its path; with `split_tensors`, as split files of at
    most that many tensors each (`<arch>-<qtype>-0000i-of-0000n.gguf`), returning the first part;
    `options` override the family's config (a Llama 3 rope scaling is written as `rope_freqs`, as
    llama.cpp's converter writes it)."""
    import gguf

    model = reference_model(arch, seed, options)
    cfg = model.config
    gguf_arch = GGUF_ARCH.get(arch, arch)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{arch}-{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch, split_max_tensors=split_tensors)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if hasattr(cfg, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _tokenizer(writer)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_freqs(rope, cfg.head_dim))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    for index, (name, data) in enumerate(_gguf_tensors(model, cfg, names)):
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if gguf_arch in ("llama", "granite") and (".attn_q." in name or ".attn_k." in name):
            data = _permute(data, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        _add(writer, gguf, name, data, qtype, index, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.glob(f"{arch}-{qtype}-*-of-*.gguf"))[0] if split_tensors else path


def cached_gguf(arch: str, qtype: str, seed: int = 0) -> Path:
    """`make_gguf`'s file kept under `~/.cache/hetserve/test-gguf/<key>/`, `key` the hash of this module's
    source, the case and the writer's versions: a served file keeps its path from run to run, so its
    prepared directory (workers/gguf/prepare.py) is made once, not once per run."""
    import hashlib
    import importlib.metadata
    import os
    import shutil
    import tempfile

    versions = [importlib.metadata.version(p) for p in ("gguf", "transformers", "torch")]
    key = hashlib.sha256("\0".join([Path(__file__).read_text(), arch, qtype, str(seed), *versions]).encode())
    target = Path("~/.cache/hetserve/test-gguf").expanduser() / key.hexdigest()[:24]
    path = target / f"{arch}-{qtype}.gguf"
    if not path.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent))
        make_gguf(arch, qtype, tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:  # written by another process meanwhile: the same bytes
            shutil.rmtree(tmp)
    return path
