"""A GGUF's metadata read as config.json (workers/gguf/config.py), key by key, and its refusals."""

from __future__ import annotations

import pytest

from workers.gguf.config import hf_config
from workers.gguf.files import GGUFError, TensorInfo
from workers.model.config import ModelConfig

META = {"general.architecture": "phi3", "phi3.block_count": 2, "phi3.embedding_length": 256,
        "phi3.feed_forward_length": 512, "phi3.attention.head_count": 4, "phi3.attention.head_count_kv": 2,
        "phi3.context_length": 4096, "phi3.attention.layer_norm_rms_epsilon": 1e-5, "phi3.rope.freq_base": 5e5,
        "tokenizer.ggml.tokens": ["a"] * 100, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
TENSORS = {"token_embd.weight": TensorInfo("token_embd.weight", "Q8_0", (100, 256), 0),
           "output.weight": TensorInfo("output.weight", "Q6_K", (100, 256), 0)}


def _config(**meta) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_config({**META, **meta}, TENSORS))


def test_every_size_comes_from_its_key():
    c = _config()
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("phi3", 2, 256, 512)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 64, 100)
    assert (c.max_position_embeddings, c.rope_theta, c.rms_norm_eps) == (4096, 5e5, 1e-5)
    assert c.torch_dtype == "bfloat16" and not c.tie_word_embeddings and c.eos_token_id == (2,)


def test_partial_rotary_sliding_window_and_rope_scaling():
    """rope.dimension_count below the head dim rotates part of each head; Phi-3's sliding_window slides
    every layer; a linear rope scaling keeps its factor."""
    c = _config(**{"phi3.rope.dimension_count": 48, "phi3.attention.sliding_window": 2047,
                   "phi3.rope.scaling.type": "linear", "phi3.rope.scaling.factor": 2.0})
    assert c.partial_rotary_factor == 0.75 and c.sliding_window == 2047
    assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == 2.0


def test_a_float_file_keeps_its_dtype():
    f16 = {k: TensorInfo(t.name, "F16", t.shape, 0) for k, t in TENSORS.items()}
    assert hf_config(META, f16)["torch_dtype"] == "float16"


@pytest.mark.parametrize(("meta", "tensors", "error"), [
    ({"general.architecture": "mamba"}, {}, r"Unsupported GGUF architecture `mamba`. Supported: llama, qwen2"),
    ({"phi3.rope.scaling.type": "longrope"}, {}, r"Unsupported GGUF rope scaling `longrope`. Supported: none"),
    ({}, {"rope_freqs.weight": TensorInfo("rope_freqs.weight", "F32", (32,), 0)}, r"`rope_freqs.weight`"),
    ({"phi3.block_count": None}, {}, r"lacks `phi3.block_count`"),
])
def test_what_we_do_not_serve_is_named(meta, tensors, error):
    with pytest.raises(GGUFError, match=error):
        hf_config({**META, **meta}, {**TENSORS, **tensors})
