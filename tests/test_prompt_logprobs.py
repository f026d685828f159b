"""Prompt scoring (echo, `decoder_input_details`): the engine's hook returns the logits of a
scored prompt's rows from the same forward, and each prompt token's logprob equals the full
causal forward's, the first one null; batch mates are unaffected; a prompt scored in pieces
(chunked prefill) gives the same entries as one piece."""

from __future__ import annotations

import types

import pytest
import torch

from tests.engine_fakes import tokenizer
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.model.config import ModelConfig
from workers.model.transformer import Transformer
from workers.sampling.logprobs import prompt_chunks, record_prompt
from workers.sampling.params import SamplingParams

VOCAB = 512
TOK = tokenizer(VOCAB)


def tiny_model() -> Transformer:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Transformer.random(cfg, dtype=torch.float32, seed=3, std=0.3)


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    streams = [engine.submit(ids, params, request_id=f"r{i}") for i, (ids, params) in enumerate(requests)]
    while engine.step():
        pass
    return [s.events for s in streams]


def test_prompt_logprobs_equal_the_full_forward_and_batch_mates_are_unaffected():
    """Guards `ModelRunner.execute_with_prompt_logits` and `record_prompt`'s row alignment
    (row j predicts token j + 1): an off-by-one shifts every value."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    scored, plain = (torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 6))

    def engine() -> Engine:
        config = SchedulerConfig(4, 64)
        runner = ModelRunner(model, model.new_kv_pool(config.num_blocks, config.block_size), "cpu")
        return Engine(runner, Scheduler(config), TOK)

    alone = run(engine(), [(plain, SamplingParams.create(max_new_tokens=4))])[0]
    ev_scored, ev_plain = run(engine(), [(scored, SamplingParams.create(max_new_tokens=4, top_n_tokens=3,
                                                                        decoder_input_details=True)),
                                          (plain, SamplingParams.create(max_new_tokens=4))])
    prefill = ev_scored[0].prefill
    assert [p[0] for p in prefill] == scored and prefill[0][1:] == (None, None)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([scored]))[0].float(), -1)  # [S, V]
    want = [ref[j - 1, scored[j]].item() for j in range(1, len(scored))]
    assert [p[1] for p in prefill[1:]] == pytest.approx(want, abs=1e-4)
    top_ids = ref[:-1].topk(3, -1).indices.tolist()
    assert [[i for i, _ in p[2]] for p in prefill[1:]] == top_ids
    assert all(e.prefill is None for e in ev_scored[1:]) and all(e.prefill is None for e in ev_plain)
    assert ev_scored[0].token_id == ref[-1].argmax().item()  # the sampling row is still the last one
    assert [e.token_id for e in ev_plain] == [e.token_id for e in alone]


def test_a_prompt_scored_in_pieces_equals_one_piece():
    prompt = list(range(10, 20))

    def seq():
        return types.SimpleNamespace(prompt_ids=prompt, output_ids=[], prompt_logprobs=None,
                                     params=SamplingParams.create(top_n_tokens=2, decoder_input_details=True))

    logits = torch.randn(len(prompt), 64, generator=torch.Generator().manual_seed(1))
    whole = seq()
    record_prompt(types.SimpleNamespace(seq=whole, start_pos=0, token_ids=prompt), logits)
    pieces = seq()
    for start, end in ((0, 4), (4, 5), (5, 10)):
        chunk = types.SimpleNamespace(seq=pieces, start_pos=start, token_ids=prompt[start:end])
        assert prompt_chunks([chunk]) == [0]
        record_prompt(chunk, logits[start:end])
    assert len(whole.prompt_logprobs) == len(prompt)
    assert pieces.prompt_logprobs == whole.prompt_logprobs
    assert prompt_chunks([types.SimpleNamespace(seq=pieces, start_pos=9, token_ids=[19])]) == []  # all scored


def test_a_scored_prompt_whose_prefix_is_cached_is_still_scored_whole():
    """Guards `_cacheable` in workers/engine/scheduler.py: a prompt asking for its logprobs may not
    start after a cached prefix (those rows would never be computed, so its entries would
    stop at the first token); the prefix computed again gives every entry, as with no cache."""
    model = tiny_model()
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    config = SchedulerConfig(2, 64)
    engine = Engine(ModelRunner(model, model.new_kv_pool(config.num_blocks, config.block_size), "cpu"),
                    Scheduler(config), TOK)
    run(engine, [(prompt, SamplingParams.create(max_new_tokens=2))])  # caches the prompt's two full blocks
    scored = SamplingParams.create(max_new_tokens=2, decoder_input_details=True)
    events = run(engine, [(prompt, scored)])[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)  # [S, V]
    assert [p[0] for p in events[0].prefill] == prompt
    assert [p[1] for p in events[0].prefill[1:]] == pytest.approx([ref[j - 1, prompt[j]].item()
                                                                   for j in range(1, len(prompt))], abs=1e-4)
    plain = run(engine, [(prompt, SamplingParams.create(max_new_tokens=2))])[0]  # the cache still serves others
    hits = [line for line in engine.metrics.render().decode().splitlines()
            if line.startswith("hetserve_worker_prefix_cache_hits_tokens_total ")]
    assert float(hits[0].split()[-1]) == 32  # the plain one reused both blocks, the scored one none
    assert [e.token_id for e in plain] == [e.token_id for e in events]
