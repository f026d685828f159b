"""Deterministic mode (workers/model/deterministic.py) on the embedded model in bfloat16: a request's
tokens do not depend on its batch mates, the batch size, chunked prefill, prefix-cache hits or preemption."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import default_model_dir
from tests.test_paged_engine import metric
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.model.cpu_projections import install_cpu_projections
from workers.model.deterministic import KV_SPLIT, ROW_TILE, enable_deterministic, split_attention, tiled_rows
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

PREFIX = ("You are a helpful assistant. Answer in one short sentence, and never repeat the question back. "
          "Here are some facts: the sky is blue, grass is green and the sea is salty. ")
QUESTIONS = ["What is the sky?", "Tell me about grass.", "Is the sea sweet?", "Hello!", "What colour is snow?",
             "Name a fruit.", "Why?", "Give me a number.", "Once upon a time", "The capital of France is",
             "def main():", "1, 2, 3,", "My favourite food is", "The weather today", "In 1999,", "Dear Sir,"]
NEW_TOKENS = 16


def _load(deterministic: bool):
    """The embedded model as a CPU worker runs it: its projections packed (in deterministic mode
    under the fixed row tiles, workers/engine/build.py `install_cpu_paths`)."""
    torch.set_num_threads(1)
    lm = load_model(default_model_dir(), "bfloat16")
    install_cpu_projections(lm.model, "cpu", lm.dtype, experts=not deterministic)
    if deterministic:
        enable_deterministic(lm.model)
    return lm


@pytest.fixture(scope="module")
def det_lm():
    return _load(True)


def serve(lm, prompts, *, max_sequences: int, budget: int = 2048, prefix: bool = True, params=None,
          blocks: int = 512):
    """Each prompt's tokens, served `max_sequences` at a time, and the engine (for its metrics)."""
    pool = KVPool.for_config(lm.config, blocks, 16, lm.dtype)
    config = SchedulerConfig(max_sequences, lm.config.max_position_embeddings, blocks, 16, budget, prefix,
                             eos_token_ids=(), cache_root=root_hash("embedded", lm.dtype), kv_groups=pool.group_shapes)
    engine = Engine(ModelRunner(lm.model, pool, "cpu", mirror=False), Scheduler(config), lm.tokenizer, max_queue=64)
    params = params or SamplingParams.create(max_new_tokens=NEW_TOKENS)
    streams = [engine.submit(lm.tokenizer.encode(p).ids, params) for p in prompts]
    while engine.step():
        pass
    return [[e.token_id for e in s.events] for s in streams], engine


def test_sixteen_greedy_requests_identical_alone_together_chunked_cached_and_preempted(det_lm):
    prompts = [PREFIX + q for q in QUESTIONS]
    alone, _ = serve(det_lm, prompts, max_sequences=1, prefix=False)  # one by one, every prompt prefilled whole
    together, _ = serve(det_lm, prompts, max_sequences=16, prefix=False)  # all 16 in one batch
    chunked, _ = serve(det_lm, prompts, max_sequences=16, budget=16, prefix=False)  # 16-token prompt chunks
    cached, engine = serve(det_lm, prompts, max_sequences=1)  # each prompt after the first hits the prefix cache
    assert metric(engine, 'hetserve_worker_prefill_tokens_total{kind="skipped"}') >= 16 * (len(prompts) - 1)
    preempted, engine = serve(det_lm, prompts, max_sequences=16, prefix=False, blocks=40)  # blocks run out
    assert metric(engine, "hetserve_worker_preemptions_total") > 0
    assert all(len(t) == NEW_TOKENS for t in alone)
    assert together == alone
    assert chunked == alone
    assert cached == alone
    assert preempted == alone


def test_seeded_sampling_identical_alone_and_together(det_lm):
    prompts = [PREFIX + q for q in QUESTIONS[:8]]
    params = SamplingParams.create(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, seed=7)
    alone, _ = serve(det_lm, prompts, max_sequences=1, params=params)
    together, _ = serve(det_lm, prompts, max_sequences=8, budget=16, params=params)
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # sampled, not one degenerate text


# -- what makes it hold --------------------------------------------------------------------


def _shape_dependent_kernels(monkeypatch, model) -> None:
    """Stand-ins for GPU kernels whose reduction order follows the problem's shape (cuBLAS picks
    split-K past a row count; attention kernels pick another tiling for a batch): projections
    of more than 4 rows add two half-K partial products in bfloat16, attention over more than
    one sequence at once computes its scores and softmax in bfloat16. Each is a fair result;
    they differ in the last bits, as real kernels do."""

    def linear_forward(self, x):
        if x.reshape(-1, x.shape[-1]).shape[0] <= 4:
            return F.linear(x, self.weight)
        h = x.shape[-1] // 2
        return F.linear(x[..., :h], self.weight[:, :h]) + F.linear(x[..., h:], self.weight[:, h:])

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            monkeypatch.setattr(module, "forward", linear_forward.__get__(module))
    sdpa = F.scaled_dot_product_attention

    def attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kwargs):
        if q.shape[0] == 1 or is_causal or kwargs:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)


def _last_logits(lm, ids, mates) -> torch.Tensor:
    """The logits after `ids`: its prompt prefilled up to the last token, which is then decoded,
    each step shared with `mates` (prompts prefilled alongside, then decoding alongside)."""
    pool = KVPool.for_config(lm.config, 64, 16, lm.dtype)
    tables = [list(range(i * 8, (i + 1) * 8)) for i in range(1 + len(mates))]
    n = len(ids) - 1
    first = [(SeqChunk(0, n, tables[0]), ids[:n])] + [(SeqChunk(0, len(m), tables[i + 1]), m)
                                                       for i, m in enumerate(mates)]
    lm.model.step(ForwardBatch.build(first, 16), pool)
    second = [(SeqChunk(n, 1, tables[0]), ids[n:])] + [(SeqChunk(len(m), 1, tables[i + 1]), [5])
                                                        for i, m in enumerate(mates)]
    return lm.model.step(ForwardBatch.build(second, 16), pool)[0]


def test_a_prompt_row_of_a_soft_capped_layer_attends_as_the_same_row_decoding():
    """Guards the stride-0 branch of `_partial` in workers/model/deterministic.py: the rows of a prompt
    chunk (or of a decode row's verified drafts) share one sequence's K/V, expanded with stride 0; in
    the matmul path (soft-capped layers on the CPU, every layer on a GPU) MKL on AVX2 multiplies such
    a batch in another order than a decode row's own copy (7.6e-6 apart on an AMD EPYC with AVX2), so
    a speculated greedy run's logprobs were not plain decoding's. Without the branch this fails on
    such CPUs; on others both paths happen to agree."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 2, 64, generator=gen)  # [R, Hkv, G, D]: five positions of one prompt
    k, v = torch.randn(1, 2, 130, 64, generator=gen), torch.randn(1, 2, 130, 64, generator=gen)
    lens = [126, 127, 128, 129, 130]
    shared = split_attention(q, k, v, lens, KV_SPLIT, softcap=20.0)
    for r, n in enumerate(lens):  # as a decode step: the row alone, its own gathered copy of the sequence
        own = split_attention(q[r:r + 1], k.clone(), v.clone(), [n], KV_SPLIT, softcap=20.0)
        assert torch.equal(shared[r], own[0]), r


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_mates_change_nothing_only_in_deterministic_mode(monkeypatch, deterministic):
    """Regression: guards `if self.kv_split is not None` in `Attention.step` (workers/model/attention.py),
    which sends every row through `attend_paged`, and `tiled_rows` in `install_row_tiles`
    (workers/model/deterministic.py). Over kernels whose numerics follow the batch's shape, a row's
    logits move with its batch mates in the default mode, and stay bit-identical in
    deterministic mode; without either line the deterministic case fails."""
    lm = load_model(default_model_dir(), "bfloat16")
    _shape_dependent_kernels(monkeypatch, lm.model)
    if deterministic:
        enable_deterministic(lm.model)
    ids = lm.tokenizer.encode(PREFIX + QUESTIONS[0]).ids
    mates = [lm.tokenizer.encode(PREFIX + q + " " + q).ids for q in QUESTIONS[1:6]]
    alone, together = _last_logits(lm, ids, []), _last_logits(lm, ids, mates)
    assert torch.equal(alone, together) == deterministic


def test_fixed_shapes_whatever_the_batch():
    """Every projection GEMM has exactly ROW_TILE rows, and a row's attention does not change
    with a longer batch mate: its splits are fixed from position 0."""
    seen = []

    def gemm(x):
        seen.append(x.shape[0])
        return x * 2

    x = torch.randn(70, 8)
    assert torch.equal(tiled_rows(gemm, x, ROW_TILE), x * 2)
    assert set(seen) == {ROW_TILE}
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.bfloat16) for s in ((2, 2, 2, 64), (2, 2, 300, 64),
                                                                               (2, 2, 300, 64)))
    alone = split_attention(q[:1], k[:1, :, :100], v[:1, :, :100], [100], KV_SPLIT)
    with_mate = split_attention(q, k, v, [100, 300], KV_SPLIT)
    assert torch.equal(alone[0], with_mate[0])
    exact = F.scaled_dot_product_attention(q[:1].float(), k[:1, :, :100].float(), v[:1, :, :100].float())
    assert torch.allclose(alone, exact, atol=5e-3)  # the CPU kernel rounds the weights to bfloat16


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_experts_rows_ignore_their_batch_mates_only_in_deterministic_mode(monkeypatch, deterministic):
    """Regression: guards `module.row_tile = row_tile` in `enable_deterministic` and `_tiles` in
    `grouped_experts` (workers/model/moe.py). Over a GEMM whose numerics follow its row count, a
    token's expert output moves with how many other tokens chose the same expert in the default
    mode, and stays bit-identical in deterministic mode."""
    import workers.model.moe as moe

    real = moe.F.linear
    monkeypatch.setattr(moe.F, "linear", lambda x, w, b=None: real(x, w, b) * (1 + 1e-3 * x.shape[0]))
    layer = moe.FusedMoE(4, 16, 8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.w_gate_up.copy_(torch.randn(layer.w_gate_up.shape, generator=gen))
        layer.w_down.copy_(torch.randn(layer.w_down.shape, generator=gen))
    model = torch.nn.Sequential(layer)
    if deterministic:
        enable_deterministic(model)
    x = torch.randn(9, 16, generator=gen)
    ids = torch.tensor([[1, 2]] * 9)  # every token picks experts 1 and 2
    weights = torch.full((9, 2), 0.5)
    with torch.no_grad():
        alone, together = layer(x[:1], ids[:1], weights[:1]), layer(x, ids, weights)[:1]
    assert torch.equal(alone, together) == deterministic


def test_a_mixture_of_experts_with_sinks_is_deterministic_alone_together_chunked_and_preempted(tmp_path):
    """gpt-oss in bfloat16 (experts, attention sinks, sliding layers): deterministic mode gives a
    request the same tokens alone, in a batch, in chunks and after preemption."""
    from tests.family_checkpoints import make_family_checkpoint

    torch.set_num_threads(1)
    lm = load_model(make_family_checkpoint("gpt_oss", tmp_path / "g"), "bfloat16")
    enable_deterministic(lm.model)
    prompts = [PREFIX + q for q in QUESTIONS[:8]]
    alone, _ = serve(lm, prompts, max_sequences=1, prefix=False)
    together, _ = serve(lm, prompts, max_sequences=8, prefix=False)
    chunked, _ = serve(lm, prompts, max_sequences=8, budget=16, prefix=False)
    preempted, engine = serve(lm, prompts, max_sequences=8, prefix=False, blocks=24)
    assert metric(engine, "hetserve_worker_preemptions_total") > 0
    assert all(len(t) == NEW_TOKENS for t in alone)
    assert together == alone and chunked == alone and preempted == alone


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus],
                         ids=["exp", "sigmoid", "silu", "softplus"])
def test_tail_free_gives_a_value_the_same_bits_in_a_tensor_of_any_size(fn):
    """`tail_free`: an element-wise function over a slice of a tensor gives each element the bits it
    gets in the whole tensor (no element in ATen's scalar tail, whatever the sizes)."""
    from workers.model.deterministic import tail_free

    x = torch.randn(90, 3, generator=torch.Generator().manual_seed(0)) * 4
    whole = tail_free(fn, x)
    for rows in (1, 7, 33):
        assert torch.equal(tail_free(fn, x[:rows]), whole[:rows])
    assert whole.shape == x.shape and torch.equal(
        whole, fn(torch.nn.functional.pad(x.flatten(), (0, 128 - 270 % 128)))[:270].view(90, 3))
