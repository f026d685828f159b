"""The model's batched `step()` over the paged KV cache against its own full causal forward,
the pool's layout and sizing, ForwardBatch packing, config parsing, and the kernel-swappable
layers."""

from __future__ import annotations

import types

import pytest
import torch
from torch.testing import assert_close

from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.mirror import DecodeMirror
from workers.kv.pool import KVPool
from workers.kv.sizing import plan_kv_blocks
from workers.model.config import ConfigError, ModelConfig
from workers.model.layers import RMSNorm, SiluAndMul
from workers.model.transformer import Transformer

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


def shuffled_tables(n_seqs: int, blocks_each: int, seed: int = 1) -> tuple[int, list[list[int]]]:
    """(pool size, block tables): every sequence's blocks scattered over a pool twice as big."""
    ids = torch.randperm(2 * n_seqs * blocks_each, generator=torch.Generator().manual_seed(seed)).tolist()
    return 2 * n_seqs * blocks_each, [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(n_seqs)]


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
    continuation over scattered blocks and a one-token prompt in one step give the full
    forward's logits."""
    model = tiny_model(**overrides)
    seqs = prompts(9, 4, 13, 7, 6)
    refs = [reference(model, s) for s in seqs]
    num_blocks, t = shuffled_tables(5, 4)
    kv = model.new_kv_pool(num_blocks, block_size=4)
    kv.data.fill_(1e4)  # stale values in unwritten positions must never be attended
    # Step 1: prefill seq0 and seq1 without their last token; the first 3 tokens of seq3.
    first = model.step(ForwardBatch.build([
        (SeqChunk(0, 8, t[0]), seqs[0][:8]), (SeqChunk(0, 3, t[1]), seqs[1][:3]), (SeqChunk(0, 3, t[3]), seqs[3][:3]),
    ], 4), kv)
    assert first.dtype == torch.float32 and first.shape == (3, TINY["vocab_size"])
    assert_close(first, torch.stack([refs[0][7], refs[1][2], refs[3][2]]), rtol=1e-4, atol=1e-4)
    # Step 2 (mixed): decode seq0 at 8 and seq1 at 3 (rows not consecutive), a fresh prefill
    # of seq2, the continuation of seq3 from position 3 (crossing a block), a one-token prompt.
    out = model.step(ForwardBatch.build([
        (SeqChunk(8, 1, t[0]), seqs[0][8:]), (SeqChunk(0, 13, t[2]), seqs[2]),
        (SeqChunk(3, 1, t[1]), seqs[1][3:]), (SeqChunk(3, 4, t[3]), seqs[3][3:]), (SeqChunk(0, 1, t[4]), seqs[4][:1]),
    ], 4), kv)
    expected = torch.stack([refs[0][8], refs[2][12], refs[1][3], refs[3][6], refs[4][0]])
    assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["strided", "scattered"])
def test_decode_rows_match_full_forward_as_view_or_gather(layout):
    """Decode rows of different lengths, read as a view of the pool (row i in blocks
    i*stride.., the copy-free path) or gathered through scattered tables, then consecutive
    decode rows followed by a prefill (the sliced mixed path)."""
    model = tiny_model()
    seqs = prompts(5, 11, 2, 8, seed=1)
    if layout == "strided":
        num_blocks, t = 16, [list(range(4 * i, 4 * i + 4)) for i in range(4)]
    else:
        num_blocks, t = shuffled_tables(4, 4, seed=2)
    kv = model.new_kv_pool(num_blocks, block_size=4)
    kv.data.fill_(1e4)
    model.step(ForwardBatch.build([(SeqChunk(0, len(s) - 1, t[i]), s[:-1]) for i, s in enumerate(seqs)], 4), kv)
    batch = ForwardBatch.build([(SeqChunk(len(s) - 1, 1, t[i]), s[-1:]) for i, s in enumerate(seqs)], 4)
    assert (batch.decode.view is not None) == (layout == "strided") and not batch.prefills
    out = model.step(batch, kv)
    assert_close(out, torch.stack([reference(model, s)[-1] for s in seqs]), rtol=1e-4, atol=1e-4)
    new = prompts(6, seed=2)[0]
    nxt = [s + [(7 * i) % 128] for i, s in enumerate(seqs)]
    mixed = ForwardBatch.build([(SeqChunk(len(s) - 1, 1, t[i]), s[-1:]) for i, s in enumerate(nxt[:3])]
                               + [(SeqChunk(0, 6, t[3]), new)], 4)
    assert mixed.decode.rows_start == 0 and mixed.prefills
    out = model.step(mixed, kv)
    assert_close(out, torch.stack([reference(model, s)[-1] for s in [*nxt[:3], new]]), rtol=1e-4, atol=1e-4)


def test_decode_mirror_gives_the_gathered_result_as_rows_join_leave_and_return():
    """The CPU engine's contiguous copy of the decoding rows (`DecodeMirror`) against the plain
    gather, step by step, while rows join, leave (the last row moves into the hole), reorder,
    grow past its capacity, and come back after a release (a preemption). One torch thread: with
    two, SDPA splits its work by the machine's load and the two layouts round apart by 1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _mirror_against_gather()
    finally:
        torch.set_num_threads(threads)


def _mirror_against_gather():
    model = tiny_model()
    seqs = prompts(5, 9, 3, 12, 7, 4, seed=5)
    num_blocks, t = shuffled_tables(6, 10, seed=3)
    kv = model.new_kv_pool(num_blocks, block_size=4)
    mirror = DecodeMirror(kv, rows=2, positions=8)
    model.step(ForwardBatch.build([(SeqChunk(0, len(s), t[i]), s) for i, s in enumerate(seqs)], 4), kv)
    lens = [len(s) for s in seqs]
    schedule = [[0, 1, 2], [0, 1, 2], [1, 2, 3, 4], [4, 3, 1], [4, 3, 1, 5, 0], [0], [0, 2, 5], [5, 2, 0]]
    for step, rows in enumerate(schedule):
        if step == 6:
            mirror.release(2)  # as after a preemption: row 2 is refilled from its blocks
        items = [(SeqChunk(lens[i], 1, t[i], key=i), [(3 * i + step) % 128]) for i in rows]
        plain = model.step(ForwardBatch.build(items, 4), kv)
        mirrored = model.step(ForwardBatch.build(items, 4, mirror=mirror), kv)
        assert_close(mirrored, plain, rtol=1e-6, atol=1e-6)
        assert sorted(mirror.keys) == sorted(rows)
        for i in rows:
            lens[i] += 1
    assert mirror.data.shape[3] >= 5 and mirror.data.shape[4] >= max(lens)  # it grew
    with pytest.raises(ValueError, match="need a `key`"):
        ForwardBatch.build([(SeqChunk(3, 1, t[0]), [1])], 4, mirror=mirror)


def test_logits_for_chosen_positions():
    """`num_logits` projects any number of a chunk's last tokens (every prompt position for
    prompt logprobs, none for a prompt chunk that does not reach the end)."""
    model = tiny_model()
    a, b = prompts(7, 5, seed=4)
    kv = model.new_kv_pool(8, block_size=4)
    out = model.step(ForwardBatch.build([(SeqChunk(0, 7, [0, 1], num_logits=7), a),
                                         (SeqChunk(0, 3, [2, 3], num_logits=0), b[:3])], 4), kv)
    assert_close(out, reference(model, a), rtol=1e-4, atol=1e-4)
    out = model.step(ForwardBatch.build([(SeqChunk(3, 2, [2, 3], num_logits=2), b[3:])], 4), kv)
    assert_close(out, reference(model, b)[3:], rtol=1e-4, atol=1e-4)


def test_step_bfloat16_close_to_float32():
    model32 = tiny_model()
    model16 = tiny_model(dtype=torch.bfloat16)
    seq = prompts(10)[0]
    outs = []
    for model in (model32, model16):
        kv = model.new_kv_pool(4, 4)
        model.step(ForwardBatch.build([(SeqChunk(0, 9, [3, 1, 0]), seq[:9])], 4), kv)
        outs.append(model.step(ForwardBatch.build([(SeqChunk(9, 1, [3, 1, 0]), seq[9:])], 4), kv))
    assert outs[1].dtype == torch.float32
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.15)


def test_step_writes_kv_only_at_its_blocks_and_offsets():
    model = tiny_model()
    kv = model.new_kv_pool(4, 4)
    model.step(ForwardBatch.build([(SeqChunk(2, 3, [2, 0]), [5, 6, 7])], 4), kv)  # positions 2, 3 | 4
    written = kv.data.abs().sum(dim=(0, 1, 2, 5))  # [blocks, offsets]
    assert (written[2, 2:4] > 0).all() and (written[0, 0] > 0).all()
    written[2, 2:4] = 0
    written[0, 0] = 0
    assert written.sum() == 0


def test_step_refuses_blocks_beyond_the_pool():
    model = tiny_model()
    kv = model.new_kv_pool(2, 4)
    with pytest.raises(ValueError, match="reads block `2`.*has 2 blocks"):
        model.step(ForwardBatch.build([(SeqChunk(0, 1, [2]), [3])], 4), kv)


def test_forward_batch_packing():
    batch = ForwardBatch.build([(SeqChunk(0, 3, [4]), [1, 2, 3]), (SeqChunk(7, 1, [6, 9]), [9]),
                                (SeqChunk(2, 1, [5]), [4])], block_size=4)
    assert batch.input_ids.tolist() == [1, 2, 3, 9, 4]
    assert batch.positions.tolist() == [0, 1, 2, 7, 2]
    assert batch.slot_mapping.tolist() == [16, 17, 18, 39, 22]  # block * 4 + offset
    assert batch.logits_index.tolist() == [2, 3, 4]
    d = batch.decode
    assert d.rows.tolist() == [3, 4] and d.seq_lens.tolist() == [8, 3] and d.max_len == 8
    assert d.block_tables.tolist() == [[6, 9], [5, 0]]  # padded with block 0
    assert d.rows_start == 3 and d.view is None and batch.max_pos == 7 and batch.max_block == 9
    assert len(batch.prefills) == 1 and batch.prefills[0].row_start == 0 and batch.prefills[0].blocks is None
    cont = ForwardBatch.build([(SeqChunk(3, 2, [7, 8, 2]), [1, 2])], 4)
    assert cont.slot_mapping.tolist() == [31, 32] and cont.prefills[0].blocks.tolist() == [[7, 8]]
    strided = ForwardBatch.build([(SeqChunk(4, 1, [3, 4]), [1]), (SeqChunk(1, 1, [6]), [1])], 4)
    assert strided.decode.view == (3, 3)  # row i reads blocks 3 + 3i ..
    with pytest.raises(ValueError, match="num_tokens == len"):
        ForwardBatch.build([(SeqChunk(0, 2, [0]), [1])], 4)
    with pytest.raises(ValueError, match="needs 2 blocks of 4 tokens, its block table has `1`"):
        ForwardBatch.build([(SeqChunk(3, 2, [0]), [1, 2])], 4)


def test_kv_pool_layout_and_budget():
    cfg = ModelConfig(**TINY)
    per_token = KVPool.bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 2 * 2 * 2 * 8 * 2  # K and V x layers x kv heads x head_dim x 2 bytes
    blocks, shape = plan_kv_blocks(per_token, 16, budget=per_token * 16 * 3 + 10, context=128)
    assert blocks == 3 and "longest request 48" in shape  # the pool, not the context, bounds a request here
    kv = KVPool.for_config(cfg, blocks, 16, torch.bfloat16)
    assert kv.data.shape == (2, 2, 2, 3, 16, 8) and kv.data.is_contiguous()  # [L, K|V, Hkv, NB, B, D]
    assert kv.nbytes == per_token * 48 and kv.layer(1).shape == (2, 2, 3, 16, 8)
    assert "longest request 128" in plan_kv_blocks(per_token, 16, 10**9, context=128)[1]
    with pytest.raises(ValueError, match="below one block of 16 tokens"):
        plan_kv_blocks(per_token, 16, budget=100, context=128)


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
    with pytest.raises(ConfigError,
                       match="rope type `su`. Supported: default, linear, dynamic, yarn, longrope, llama3"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "su", "factor": 2}})
    with pytest.raises(ConfigError, match="Rope type `linear` needs `factor`"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "linear"}})
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
        kv = model.new_kv_pool(8, 4)
        model.step(ForwardBatch.build([(SeqChunk(0, 8, [5, 2, 7]), seqs[0][:8])], 4, device), kv)
        outs.append(model.step(ForwardBatch.build(
            [(SeqChunk(8, 1, [5, 2, 7]), seqs[0][8:]), (SeqChunk(0, 4, [1]), seqs[1])], 4, device), kv).cpu())
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.15)
