"""Speculative decoding through the real engine on the embedded model (fp32 over the paged KV
cache): greedy outputs are those of plain decoding, in a batch, with the prefix cache and under
preemption; rejected drafts give their blocks back; stops and `max_new_tokens` cut a draft."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import default_model_dir
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculate import Speculator, speculator_for
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams
from workers.spec.policy import SpecPolicy

SEEDS = ["one two three four one two three four", "Tell me about grass.", "Why is the sky blue?",
         "Name a fruit."]
OTHERS = ["Hello!", "a b c d e f a b c", "def add(x, y):", "Give me a number."]


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return load_model(default_model_dir(), "float32")


@pytest.fixture(scope="module")
def echoes(lm):
    """Prompts that hold a text and end where it began (`seed + continuation + seed`, the
    continuation the model's own): the model writes much of the text again, so drafts get accepted."""
    seeds = [lm.tokenizer.encode(p).ids for p in SEEDS]
    continued, _, _ = run(make(lm, False), lm, seeds, SamplingParams.create(max_new_tokens=32))
    return [ids + c + ids for ids, c in zip(seeds, continued, strict=True)]


def make(lm, spec: bool, *, num_blocks=512, block_size=16, prefix=True, max_sequences=8, k=4, max_rows=8):
    pool = KVPool.for_config(lm.config, num_blocks, block_size, lm.dtype)
    config = SchedulerConfig(max_sequences, lm.config.max_position_embeddings, num_blocks, block_size, 2048,
                             prefix, eos_token_ids=(), cache_root=root_hash("embedded", lm.dtype))
    speculator = Speculator("ngram", SpecPolicy(k, max_rows)) if spec else None
    return Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=64,
                  speculator=speculator)


def run(engine, lm, prompts, params):
    """Every prompt (text or token ids) served at once: (token ids per prompt, streams, steps)."""
    streams = [engine.submit(p if isinstance(p, list) else lm.tokenizer.encode(p).ids, params) for p in prompts]
    steps = 0
    while engine.step():
        steps += 1
    for s in streams:
        assert [e.index for e in s.events] == list(range(len(s.events)))  # every token once, in order
    assert engine.scheduler.kv.usage == 0 and engine.load() == (0, 0)
    return [[e.token_id for e in s.events] for s in streams], streams, steps


def metric(engine, name: str) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_greedy_outputs_are_plain_decodings_in_a_batch_with_fewer_steps(lm, echoes):
    params = SamplingParams.create(max_new_tokens=32)
    plain, plain_streams, _ = run(make(lm, False), lm, echoes + OTHERS, params)
    engine = make(lm, True)
    spec, spec_streams, _ = run(engine, lm, echoes + OTHERS, params)
    assert spec == plain
    for a, b in zip(plain_streams, spec_streams, strict=True):  # logprobs and text as plain decoding's
        assert [e.text for e in a.events] == [e.text for e in b.events]
        assert [e.logprob for e in a.events] == pytest.approx([e.logprob for e in b.events], abs=1e-4)
    accepted = metric(engine, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    assert metric(engine, "vllm:spec_decode_num_draft_tokens_total") >= accepted
    assert metric(engine, "vllm:spec_decode_num_drafts_total") > 0
    described = engine.speculation()
    assert described["method"] == "ngram" and 0 < described["acceptance_rate"] <= 1
    # alone, the rows that accept drafts finish in fewer steps (the batch above waits for the others)
    assert run(make(lm, True), lm, echoes, params)[2] < run(make(lm, False), lm, echoes, params)[2]


def test_greedy_outputs_unchanged_with_the_prefix_cache_and_under_preemption(lm, echoes):
    params = SamplingParams.create(max_new_tokens=24)
    prompts = echoes + echoes[:2]  # the last two find their prefix cached
    plain, _, _ = run(make(lm, False, prefix=False), lm, prompts, params)
    cached = make(lm, True, prefix=True, max_sequences=2)
    assert run(cached, lm, prompts, params)[0] == plain
    assert metric(cached, "vllm:spec_decode_num_accepted_tokens_total") > 0
    longest = max(len(p) for p in prompts) + 24
    for prefix in (False, True):
        tight = make(lm, True, num_blocks=-(-longest // 4) + 4, block_size=4, prefix=prefix)
        assert run(tight, lm, prompts, params)[0] == plain
        assert tight.scheduler.num_preemptions > 0
        assert metric(tight, "vllm:spec_decode_num_accepted_tokens_total") > 0


def test_sampled_outputs_follow_the_seed_as_plain_sampling_does(lm, echoes):
    """One uniform per emitted token from the request's generator: with the same logits, the same
    seed draws the same tokens with or without drafts."""
    params = SamplingParams.create(max_new_tokens=24, do_sample=True, temperature=0.7, seed=11)
    plain, _, _ = run(make(lm, False), lm, echoes[:2], params)
    engine = make(lm, True)
    assert run(engine, lm, echoes[:2], params)[0] == plain
    assert metric(engine, "vllm:spec_decode_num_accepted_tokens_total") > 0


def test_rejected_drafts_give_their_blocks_back(lm, echoes):
    """Guards `sched.kv.trim(seq, seq.num_computed)` in `Speculator._settle`: without it, a row
    keeps the blocks its rejected drafts were written to."""
    engine = make(lm, True, block_size=2, k=6)
    kv = engine.scheduler.kv
    prompt = echoes[0]
    stream = engine.submit(prompt, SamplingParams.create(max_new_tokens=20))
    engine.step()  # the prompt and the first token
    seq = engine.scheduler.running[0]
    free_before, held_before = kv.num_free_blocks, len(seq.block_ids)
    original = engine.speculator.propose

    def wrong_drafts(running):  # drafts no model would continue with: all rejected
        original(running)
        seq.draft_ids = [lm.config.vocab_size - 1] * 6

    engine.speculator.propose = wrong_drafts
    engine.step()
    assert len(stream.events) == 2  # only the corrected token came out
    assert seq.num_computed == len(prompt) + 1
    assert len(seq.block_ids) == -(-seq.num_computed // 2)
    assert kv.num_free_blocks == free_before - (len(seq.block_ids) - held_before)  # the drafts' blocks returned


def test_max_new_tokens_and_stop_strings_cut_an_accepted_draft(lm, echoes):
    """A draft that runs past `max_new_tokens`, or past a stop string, emits nothing after it."""
    prompt = lm.tokenizer.encode(SEEDS[1]).ids
    plain, plain_streams, _ = run(make(lm, False), lm, [prompt], SamplingParams.create(max_new_tokens=12))
    text = plain_streams[0].events[-1].finish.generated_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for params in (SamplingParams.create(max_new_tokens=5),
                   SamplingParams.create(max_new_tokens=12, stop=[stop], include_stop_str_in_output=False)):
        engine = make(lm, True, k=8)
        original = engine.speculator.propose

        def long_drafts(running, original=original):  # the true continuation, far past the request's end
            original(running)
            for seq in running:
                if seq.output_ids:
                    seq.draft_ids = plain[0][len(seq.output_ids):len(seq.output_ids) + 8]

        engine.speculator.propose = long_drafts
        stream = engine.submit(prompt, params)
        while engine.step():
            pass
        events = stream.events
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].finish is not None and all(e.finish is None for e in events[:-1])
        if params.max_new_tokens == 5:
            assert [e.token_id for e in events] == plain[0][:5] and events[-1].finish.reason == "length"
        else:
            finish = events[-1].finish
            assert finish.reason == "stop_sequence" and finish.generated_text == text[: text.index(stop)]
            assert len(events) < 12
        assert engine.scheduler.kv.usage == 0


def test_engines_that_cannot_roll_back_do_not_speculate_and_say_why(lm):
    engine = make(lm, True)
    off = speculator_for("ngram", 4, engine.scheduler, pipeline=True)
    assert not off.enabled and "pipeline" in off.describe()["reason"]
    assert speculator_for("auto", 4, engine.scheduler).describe()["method"] == "off"  # bfloat16 may round apart
    assert speculator_for("auto", 4, engine.scheduler, exact=True).describe()["method"] == "suffix"
    assert not speculator_for("auto", 4, Scheduler(SchedulerConfig(4, 512, 64, 16, rope=(256, "longrope"))),
                              exact=True).enabled
    assert speculator_for("ngram", 4, engine.scheduler).enabled
    roped = Scheduler(SchedulerConfig(4, 512, 64, 16, rope=(256, "longrope")))
    assert "rotary" in speculator_for("ngram", 4, roped).describe()["reason"]
    sliding = Scheduler(SchedulerConfig(4, 512, 64, 16, kv_groups=((None, 64), (32, 64))))
    assert speculator_for("ngram", 4, sliding).enabled  # trims and slides (tests/test_spec_rollback.py)


def test_greedy_bfloat16_identical_in_deterministic_mode():
    """Deterministic mode (fixed row tiles and attention splits): a drafted row's logits from the
    prompt path round as the decode step's, so bfloat16 greedy outputs are plain decoding's too."""
    from tests.test_deterministic import PREFIX, QUESTIONS, _load

    lm = _load(True)

    def serve(prompts, spec: bool):
        pool = KVPool.for_config(lm.config, 512, 16, lm.dtype)
        config = SchedulerConfig(8, lm.config.max_position_embeddings, 512, 16, 2048, True, eos_token_ids=(),
                                 cache_root=root_hash("embedded", lm.dtype), kv_groups=pool.group_shapes)
        speculator = Speculator("ngram", SpecPolicy(4, 8)) if spec else None
        engine = Engine(ModelRunner(lm.model, pool, "cpu", mirror=False), Scheduler(config), lm.tokenizer,
                        max_queue=64, speculator=speculator)
        return run(engine, lm, prompts, SamplingParams.create(max_new_tokens=24))[0], engine

    seeds = [lm.tokenizer.encode(PREFIX + q).ids for q in QUESTIONS[:6]]
    continued, _ = serve(seeds, False)
    echoes = [s + c + s for s, c in zip(seeds, continued, strict=True)]
    plain, _ = serve(echoes, False)
    spec, engine = serve(echoes, True)
    assert spec == plain
    assert metric(engine, "vllm:spec_decode_num_accepted_tokens_total") > 0
