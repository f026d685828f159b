"""A GGUF's metadata as the Hugging Face config.json our loader reads.

Design: llama.cpp writes each architecture's hyper-parameters under `{arch}.*` keys
(`llama.block_count`, `qwen3.attention.head_count_kv`, ...); `hf_config` maps them to
config.json's fields for the families we serve from GGUF (`ARCHITECTURES`), and reads what the
format leaves implicit from the tensor table: a tied head (no `output.weight`), biases (an
`attn_q.bias`). The checkpoint dtype it reports is the file's float type where its matrices are
floats, else bfloat16 (a quantized file's weights are dequantized into the compute dtype, which
`--dtype auto` then picks per device as for any checkpoint). Trade-off: only keys that change the
computation are read; one the format can carry and we do not serve (a rope scaling other than
linear/yarn, a `rope_freqs` tensor that is no Llama 3 scaling) is refused by name rather than ignored.
"""

from __future__ import annotations

from typing import Any

from workers.gguf.files import GGUFError, TensorInfo
from workers.gguf.rope_freqs import llama3_from_rope_freqs

# GGUF `general.architecture` -> (config.json `architectures[0]`, `model_type`)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "granite": ("GraniteForCausalLM", "granite"),
}
# llama.cpp's converter interleaves the rotary halves of q and k rows for these (its `LlamaModel.permute`)
PERMUTED_QK = ("llama", "granite")
# llama.cpp's converter stores these families' RMSNorm weights as 1 + w (its norm multiplies by the weight)
NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's own Gemma rules, which the metadata does not carry: the 27B models (by layer count)
# scale queries by hidden/heads, the others by the head dim; Gemma 3's sliding layers rotate with base 10,000
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ROPE_SCALINGS = ("none", "linear", "yarn")


def architecture(meta: dict[str, Any]) -> str:
    """The file's architecture when we serve it; a `GGUFError` listing those we serve otherwise."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"Unsupported GGUF architecture `{arch}`. Supported: {', '.join(ARCHITECTURES)}")
    return arch


def _dtype(tensors: dict[str, TensorInfo]) -> str:
    matrices = {t.type_name for t in tensors.values() if len(t.shape) >= 2}
    if len(matrices) == 1 and (only := next(iter(matrices))) in FLOAT_TYPES:
        return FLOAT_TYPES[only]
    return "bfloat16"


def _rope(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ROPE_SCALINGS:
        raise GGUFError(f"Unsupported GGUF rope scaling `{kind}`. Supported: {', '.join(ROPE_SCALINGS)}")
    params: dict[str, Any] = {"rope_theta": theta, "rope_type": "default" if kind == "none" else kind}
    if kind != "none":
        params["factor"] = float(meta[f"{arch}.rope.scaling.factor"])
        if kind == "yarn":
            params["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
    return params


def hf_config(meta: dict[str, Any], tensors: dict[str, TensorInfo], rope_freqs=None) -> dict[str, Any]:
    """config.json's fields for the GGUF model of `meta` (first file's keys) and `tensors` (all files'), with
    `rope_freqs` the values of that tensor where the file has one (Llama 3's rope scaling: rope_freqs.py)."""
    arch = architecture(meta)
    hf_class, model_type = ARCHITECTURES[arch]
    if arch == "llama" and meta.get("llama.expert_count"):  # llama.cpp writes Mixtral as a Llama with experts
        hf_class, model_type = "MixtralForCausalLM", "mixtral"
    if "rope_freqs.weight" in tensors and rope_freqs is None:
        raise GGUFError("Unsupported GGUF tensor `rope_freqs.weight` (per-frequency rope factors). "
                        "Supported: rope scaling from metadata (" + ", ".join(ROPE_SCALINGS) + ")")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks `{arch}.{name}`")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    rope = _rope(meta, arch)
    if rope_freqs is not None:
        dim = int(meta.get(f"{arch}.rope.dimension_count") or key("attention.key_length", hidden // heads))
        llama3 = llama3_from_rope_freqs(rope_freqs, rope["rope_theta"], dim)
        if llama3 is not None and rope["rope_type"] != "default":
            raise GGUFError(f"Unsupported GGUF rope: `rope_freqs.weight` beside the scaling `{rope['rope_type']}`. "
                            "Supported: one of them")
        rope |= llama3 or {}
    out: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens) or tensors["token_embd.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": _dtype(tensors),
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    if arch in ("llama", "qwen3", "qwen3moe", "granite"):
        out["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if model_type in ("llama", "granite"):
        out["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if model_type == "mixtral":  # every layer has experts of feed_forward_length
        del out["attention_bias"]
        out.update(num_local_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")))
    head_dim, rotary = out["head_dim"], meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:  # only the first dims of each head rotate (Phi-4-mini)
        out["rope_parameters"]["partial_rotary_factor"] = int(rotary) / head_dim
    if (w := meta.get(f"{arch}.attention.sliding_window")) and arch == "phi3":  # every layer slides
        out["sliding_window"] = int(w)
    if arch == "granite":  # its four multipliers
        out.update(attention_multiplier=float(key("attention.scale")),
                   embedding_multiplier=float(key("embedding_scale")),
                   residual_multiplier=float(key("residual_scale")), logits_scaling=float(key("logit_scale")))
    if arch in NORM_PLUS_ONE:
        del out["hidden_act"]
        wide = int(key("block_count")) == GEMMA_27B_LAYERS[arch]
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=hidden // heads if wide else
                   out["head_dim"], sliding_window=int(key("attention.sliding_window")))
        if arch == "gemma2":
            out.update(attn_logit_softcapping=meta.get("gemma2.attn_logit_softcapping"),
                       final_logit_softcapping=meta.get("gemma2.final_logit_softcapping"))
        else:
            out.update(rope_local_base_freq=10_000.0, sliding_window_pattern=6)
    if arch == "qwen3moe":  # every layer has experts; llama.cpp's graph renormalizes the top-k weights
        out.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True)
    return out
