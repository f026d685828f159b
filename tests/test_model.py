"""The model's batched `step()` against its own full causal forward, the KV cache layout and
sizing, ForwardBatch packing, config parsing, and the kernel-swappable layers."""

from __future__ import annotations

import types

import pytest
import torch
from torch.testing import assert_close

from workers.config import ConfigError, ModelConfig
from workers.kv_cache import ForwardBatch, KVCache, SeqChunk
from workers.layers import RMSNorm, SiluAndMul
from workers.model import Transformer

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(dtype=torch.float32, **overrides) -> Transformer:
    cfg = ModelConfig(**{**TINY, **overrides})
    model = Transformer.random(cfg, dtype=dtype, seed=3, std=0.3)
    if cfg.attention_bias:
        with torch.no_grad():
            for layer in model.layers:
                layer.attention.wqkv.bias.normal_(0, 0.3)
    return model


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def reference(model: Transformer, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]))[0].float()  # [S, V]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_key_value_heads": 4}, {"num_key_value_heads": 1, "tie_word_embeddings": True},
     {"architecture": "qwen2", "attention_bias": True},
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}],
    ids=["gqa", "mha", "mqa-tied", "qkv-bias", "llama3-rope"],
)
def test_mixed_step_matches_full_forward(overrides):
    """Prefills of different lengths, decodes at different positions, a chunked-prefill
    continuation and out-of-order slots in one step give the full forward's logits."""
    model = tiny_model(**overrides)
    seqs = prompts(9, 4, 13, 7, 6)
    refs = [reference(model, s) for s in seqs]
    kv = model.new_kv_cache(num_slots=8, max_seq_len=32)
    # Step 1: prefill seq0 (slot 6) and seq1 (slot 2) without their last token; first 3 of seq3.
    first = model.step(ForwardBatch.build([
        (SeqChunk(6, 0, 8), seqs[0][:8]), (SeqChunk(2, 0, 3), seqs[1][:3]), (SeqChunk(1, 0, 3), seqs[3][:3]),
    ]), kv)
    assert first.dtype == torch.float32 and first.shape == (3, TINY["vocab_size"])
    assert_close(first, torch.stack([refs[0][7], refs[1][2], refs[3][2]]), rtol=1e-4, atol=1e-4)
    # Step 2 (mixed): decode seq0 at 8 and seq1 at 3 (slots 6, 2: not consecutive -> gather),
    # fresh prefill seq2, continuation of seq3 from position 3, one-token prompt seq4.
    out = model.step(ForwardBatch.build([
        (SeqChunk(6, 8, 1), seqs[0][8:]), (SeqChunk(0, 0, 13), seqs[2]),
        (SeqChunk(2, 3, 1), seqs[1][3:]), (SeqChunk(1, 3, 4), seqs[3][3:]), (SeqChunk(4, 0, 1), seqs[4][:1]),
    ]), kv)
    expected = torch.stack([refs[0][8], refs[2][12], refs[1][3], refs[3][6], refs[4][0]])
    assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_decode_only_consecutive_slots_matches_full_forward():
    """The view path (consecutive slots, no gather) with rows of different lengths masked."""
    model = tiny_model()
    seqs = prompts(5, 11, 2, 8, seed=1)
    kv = model.new_kv_cache(num_slots=5, max_seq_len=16)
    kv.k.fill_(1e4)  # stale garbage past each sequence's length must be masked out
    kv.v.fill_(1e4)
    model.step(ForwardBatch.build([(SeqChunk(i, 0, len(s) - 1), s[:-1]) for i, s in enumerate(seqs)]), kv)
    batch = ForwardBatch.build([(SeqChunk(i, len(s) - 1, 1), s[-1:]) for i, s in enumerate(seqs)])
    assert batch.decode_slot_start == 0 and not batch.prefills
    out = model.step(batch, kv)
    assert_close(out, torch.stack([reference(model, s)[-1] for s in seqs]), rtol=1e-4, atol=1e-4)
    # Consecutive decode rows followed by a prefill (the sliced, gather-free mixed path).
    new = prompts(6, seed=2)[0]
    nxt = [s + [(7 * i) % 128] for i, s in enumerate(seqs)]
    mixed = ForwardBatch.build([(SeqChunk(i, len(s) - 1, 1), s[-1:]) for i, s in enumerate(nxt)]
                               + [(SeqChunk(4, 0, 6), new)])
    assert mixed.decode_rows_start == 0 and mixed.prefills
    out = model.step(mixed, kv)
    assert_close(out, torch.stack([reference(model, s)[-1] for s in [*nxt, new]]), rtol=1e-4, atol=1e-4)


def test_step_bfloat16_close_to_float32():
    model32 = tiny_model()
    model16 = tiny_model(dtype=torch.bfloat16)
    seq = prompts(10)[0]
    outs = []
    for model in (model32, model16):
        kv = model.new_kv_cache(2, 16)
        model.step(ForwardBatch.build([(SeqChunk(1, 0, 9), seq[:9])]), kv)
        outs.append(model.step(ForwardBatch.build([(SeqChunk(1, 9, 1), seq[9:])]), kv))
    assert outs[1].dtype == torch.float32
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.15)


def test_step_writes_kv_only_at_its_slot_and_positions():
    model = tiny_model()
    kv = model.new_kv_cache(3, 8)
    model.step(ForwardBatch.build([(SeqChunk(1, 2, 3), [5, 6, 7])]), kv)
    written = kv.k.abs().sum(dim=(0, 2, 4))  # [slots, S]
    assert (written[1, 2:5] > 0).all()
    written[1, 2:5] = 0
    assert written.sum() == 0


def test_step_refuses_position_beyond_cache():
    model = tiny_model()
    kv = model.new_kv_cache(1, 4)
    with pytest.raises(ValueError, match="max_seq_len=4"):
        model.step(ForwardBatch.build([(SeqChunk(0, 4, 1), [3])]), kv)


def test_forward_batch_packing():
    batch = ForwardBatch.build([(SeqChunk(3, 0, 3), [1, 2, 3]), (SeqChunk(5, 7, 1), [9]), (SeqChunk(6, 2, 1), [4])])
    assert batch.input_ids.tolist() == [1, 2, 3, 9, 4]
    assert batch.positions.tolist() == [0, 1, 2, 7, 2]
    assert batch.slots.tolist() == [3, 3, 3, 5, 6]
    assert batch.logits_index.tolist() == [2, 3, 4]
    assert batch.decode_rows.tolist() == [3, 4] and batch.decode_lens.tolist() == [8, 3]
    assert batch.decode_slot_start == 5 and batch.decode_max_len == 8 and batch.max_pos == 7
    assert len(batch.prefills) == 1 and batch.prefills[0].row_start == 0
    with pytest.raises(ValueError, match="num_tokens=2"):
        ForwardBatch.build([(SeqChunk(0, 0, 2), [1])])
    with pytest.raises(ValueError, match="Slot `0` appears twice"):
        ForwardBatch.build([(SeqChunk(0, 0, 1), [1]), (SeqChunk(0, 1, 1), [1])])


def test_kv_cache_layout_and_budget():
    cfg = ModelConfig(**TINY)
    per_token = KVCache.bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 2 * 2 * 2 * 8 * 2  # K and V x layers x kv heads x head_dim x 2 bytes
    kv = KVCache.for_budget(cfg, torch.bfloat16, "cpu", budget_bytes=per_token * 64 * 3 + 10,
                            max_slots=8, max_seq_len=64)
    assert (kv.num_slots, kv.max_seq_len) == (3, 64)
    assert kv.k.shape == (2, 3, 2, 64, 8) and kv.k.is_contiguous()
    assert kv.nbytes == per_token * 64 * 3
    assert KVCache.for_budget(cfg, torch.float32, "cpu", 10**9, max_slots=5, max_seq_len=10**6).max_seq_len == 128
    with pytest.raises(ValueError, match="below one sequence"):
        KVCache.for_budget(cfg, torch.float32, "cpu", budget_bytes=100, max_slots=4, max_seq_len=64)


def test_from_config_builds_on_meta_and_load_weights_assigns():
    cfg = ModelConfig(**TINY, tie_word_embeddings=True)
    model = Transformer.from_config(cfg, torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())
    source = Transformer.random(cfg, torch.bfloat16)
    sd = {k: v for k, v in source.state_dict().items() if k != "output.weight"}
    model.load_weights(sd)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.data_ptr() == sd["tok_embeddings.weight"].data_ptr()  # assigned, not copied
    ids = torch.tensor([[1, 2, 3]])
    assert_close(model(ids), source(ids))


def test_rmsnorm_and_silu_and_mul_reference():
    norm = RMSNorm(8, eps=1e-5)
    assert norm.kernel_layer_name == "RMSNorm" and SiluAndMul.kernel_layer_name == "SiluAndMul"
    assert norm.variance_epsilon == 1e-5
    with torch.no_grad():
        norm.weight.copy_(torch.arange(8.0))
    x = torch.randn(3, 8)
    assert_close(norm(x), torch.arange(8.0) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    y = torch.randn(2, 5, 6)
    assert_close(SiluAndMul()(y), torch.nn.functional.silu(y[..., :3]) * y[..., 3:])


def test_stateless_kernel_forward_can_replace_reference_layers():
    """A kernel layer (no state, same forward signature) bound to our modules runs and is used."""
    calls = {"RMSNorm": 0, "SiluAndMul": 0}

    class KernelRMSNorm:
        def forward(self, x):
            calls["RMSNorm"] += 1
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    class KernelSiluAndMul:
        def forward(self, x):
            calls["SiluAndMul"] += 1
            a, b = x.chunk(2, dim=-1)
            return torch.sigmoid(a) * a * b

    model = tiny_model()
    ids = torch.tensor([prompts(6)[0]])
    before = model(ids)
    for module in model.modules():
        kernel = {RMSNorm: KernelRMSNorm, SiluAndMul: KernelSiluAndMul}.get(type(module))
        if kernel:
            module.forward = types.MethodType(kernel.forward, module)
    assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    assert calls == {"RMSNorm": 5, "SiluAndMul": 2}


def test_config_from_hf_spellings_and_errors():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    v4 = ModelConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                                     "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     "eos_token_id": [1, 7]})
    assert v4.rope_theta == 5e5 and v4.rope_scaling["rope_type"] == "llama3"
    assert v4.num_key_value_heads == 4 and v4.head_dim == 16 and v4.eos_token_id == (1, 7)
    v5 = ModelConfig.from_hf_config({**base, "model_type": "qwen2", "rope_parameters": {"rope_type": "default",
                                                                                          "rope_theta": 1e6}})
    assert v5.architecture == "qwen2" and v5.attention_bias and v5.rope_scaling is None and v5.rope_theta == 1e6
    with pytest.raises(ConfigError, match="`GPT2LMHeadModel`.*LlamaForCausalLM"):
        ModelConfig.from_hf_config({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope type `yarn`"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2}})
    assert ModelConfig.from_hf_config(ModelConfig(**TINY, tie_word_embeddings=True).to_hf_config()) == ModelConfig(
        **TINY, tie_word_embeddings=True, torch_dtype="float32")


@pytest.mark.gpu
def test_step_on_cuda_matches_cpu():
    """The same mixed step on a CUDA device (bf16) stays close to the CPU fp32 result."""
    cpu = tiny_model()
    gpu = Transformer.from_config(cpu.config, torch.bfloat16)
    gpu.load_weights({k: v.to("cuda", torch.bfloat16) for k, v in cpu.state_dict().items()})
    seqs = prompts(9, 4)
    outs = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        kv = model.new_kv_cache(4, 16)
        model.step(ForwardBatch.build([(SeqChunk(3, 0, 8), seqs[0][:8])], device), kv)
        outs.append(model.step(ForwardBatch.build(
            [(SeqChunk(3, 8, 1), seqs[0][8:]), (SeqChunk(1, 0, 4), seqs[1])], device), kv).cpu())
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.15)
