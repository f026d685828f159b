"""Tiny random checkpoints of every family in the registry, written by transformers itself.

Each case is `AutoConfig.for_model(model_type, ...)` with the family's distinguishing options
switched on (a sliding window shorter than the test prompts, soft-caps, q/k norms, partial
rotary, LongRoPE crossing its original length, NoPE layers, multipliers, post-norms), then
`AutoModelForCausalLM.from_config` in fp32 and `save_pretrained`, with the embedded model's
tokenizer beside it (vocabulary 4096). Weights are random with a small spread, so greedy
tokens vary from step to step; the checkpoint is what transformers writes, so our loader
reads the real tensor names and config spellings of transformers 5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.contract import DEFAULT_MODEL_DIR

VOCAB = 4096
WINDOW = 16  # shorter than every test prompt
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False, initializer_range=0.05)
_ROT = 16 // 2  # rotary dim / 2 of a head of 16
_PARTIAL = 8 // 2  # phi3's partial rotary (0.5 of 16) / 2
_LAYERS4 = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_conv_kernel_dim=4)
_SHARED_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_S, _F = "sliding_attention", "full_attention"
# Gemma 4: global layers of twice the head dim with one KV head (values = keys), a proportional
# rotary on them; the dense case shares the KV of layers 0 (sliding) and 1 (global) with layers 2
# and 3 (double-wide MLPs there) and feeds per-layer inputs; the MoE case has experts beside each MLP
_GEMMA4 = dict(sliding_window=WINDOW, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
               final_logit_softcapping=30.0, initializer_range=0.02)

# case -> (model_type, options). A case's name starts with its family.
CASES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 128})),
    "llama-dynamic": ("llama", dict(max_position_embeddings=48,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": ("qwen3", dict(attention_bias=True, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0, initializer_range=0.02)),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=_LAYERS4,
                                   initializer_range=0.02,
                                   rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                       "factor": 8.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}})),
    "phi3": ("phi3", dict(max_position_embeddings=512, original_max_position_embeddings=32,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                           "short_factor": [1.0 + 0.1 * i for i in range(_PARTIAL)],
                                           "long_factor": [2.0 + 0.5 * i for i in range(_PARTIAL)]})),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 1, 1, 0], use_sliding_window=True, sliding_window=WINDOW,
                                attention_bias=True, tie_word_embeddings=True)),
    "olmo2": ("olmo2", dict()),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW)),
    "granite": ("granite", dict(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                logits_scaling=4.0)),
    # mixtures of experts: 4 to 8 experts, the family's top-k, a dense layer between sparse ones
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "gemma4": ("gemma4_text", dict(_GEMMA4, layer_types=[_S, _F, _S, _F], num_kv_shared_layers=2,
                                   use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                                   vocab_size_per_layer_input=VOCAB)),
    "gemma4_moe": ("gemma4_text", dict(_GEMMA4, layer_types=[_S, _S, _S, _F], enable_moe_block=True, num_experts=4,
                                       top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=0)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                initializer_range=0.1,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
    # hybrids: three Gated DeltaNet layers, then one gated full-attention layer (partial rotary 0.25);
    # two key heads for four value heads; the MoE ones with a gated shared expert
    "qwen3_5": ("qwen3_5_text", dict(_LINEAR)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_LINEAR, **_SHARED_MOE)),
    "qwen3_next": ("qwen3_next", dict(_LINEAR, **_SHARED_MOE, decoder_sparse_step=1, mlp_only_layers=[2])),
}


# Cases whose scales transformers initializes to exactly 1 (Gemma 4's norms, `layer_scalar`, router
# and per-expert scales): they get random values near 1 before saving, so each one is seen used.
UNIT_SCALES_PERTURBED = ("gemma4", "gemma4_moe")


def _perturb_unit_scales(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and t.numel() and bool((t == 1).all()):
                t.mul_(1 + 0.25 * torch.randn(t.shape, generator=gen))


def make_family_checkpoint(case: str, out: Path, seed: int = 0) -> Path:
    """Write case `case`'s checkpoint (config.json, model.safetensors, generation config, tokenizer) to `out`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, options = CASES[case]
    if model_type not in CONFIG_MAPPING:  # an older transformers: say so rather than fail somewhere inside it
        raise RuntimeError(f"transformers {transformers.__version__} ships no config class for `{model_type}` "
                           f"(case `{case}`); its reference is what this case is proven against: upgrade transformers")
    cfg = AutoConfig.for_model(model_type, **{**BASE, **options})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    if case in UNIT_SCALES_PERTURBED:
        _perturb_unit_scales(model, seed)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    return out


# Benchmark-sized checkpoints: each family's case at the size of benchmarks/decode_vs_transformers.py's
# Llama (hidden 256, 4 layers, 4 heads / 2 KV heads of 64, vocab 4096, tied embeddings), the same
# distinguishing options on, sized to the benchmark's sequences: a window shorter than its prompt,
# LongRoPE's original length shorter than its prompt (so the long factors apply throughout).
BENCH_WINDOW = 48
BENCH_ORIGINAL = 32
BENCH_EXPERT = 176  # Qwen3-MoE's expert width; the other families' experts take `intermediate_size`
BENCH = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)


def bench_config(case: str) -> tuple[str, dict]:
    """(model_type, config options) of case `case` at benchmark size (`BENCH`)."""
    if case not in CASES:
        raise KeyError(f"Unknown case `{case}`. Known: {', '.join(CASES)}")
    model_type, options = CASES[case]
    out = {**BASE, **options, **BENCH}
    if out.get("sliding_window") is not None:
        out["sliding_window"] = BENCH_WINDOW
    if out.get("moe_intermediate_size") is not None:  # experts about a quarter the dense width (16-byte rows)
        out["moe_intermediate_size"] = BENCH_EXPERT
    if out.get("global_head_dim") is not None:  # Gemma 4: global heads twice the sliding ones (512 to 256)
        out["global_head_dim"] = 2 * BENCH["head_dim"]
    if out.get("hidden_size_per_layer_input"):  # its per-layer inputs an eighth of the hidden width
        out["hidden_size_per_layer_input"] = BENCH["hidden_size"] // 8
    rope = out.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        half = int(BENCH["head_dim"] * rope.get("partial_rotary_factor", 1.0)) // 2
        out["original_max_position_embeddings"] = BENCH_ORIGINAL
        out["rope_parameters"] = {**rope, "short_factor": [1.0 + 0.1 * i / half for i in range(half)],
                                  "long_factor": [2.0 + 8.0 * i / half for i in range(half)]}
    return model_type, out


def make_bench_checkpoint(case: str, out: Path, seed: int = 0) -> Path:
    """Write case `case`'s benchmark-sized checkpoint (`bench_config`) to `out`, as `make_family_checkpoint` does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, options = bench_config(case)
    cfg = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    return out
