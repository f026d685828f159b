"""The engine on the embedded model (fp32, greedy) over the paged KV cache: prefix caching,
chunked prefill and preemption change how much is computed, never what comes out."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import default_model_dir
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

PREFIX = ("You are a helpful assistant. Answer in one short sentence, and never repeat the "
          "question back. Here are some facts: the sky is blue, grass is green and the sea is salty.")
SUFFIXES = ["What is the sky?", "Tell me about grass.", "Is the sea sweet?", "Hello!", "What colour is snow?",
            "Name a fruit.", "Why?", "Give me a number."]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return load_model(default_model_dir(), "float32")


def run(lm, prompts: list[str], *, num_blocks=512, block_size=16, budget=2048, prefix=True, max_sequences=8,
        new_tokens=NEW_TOKENS):
    """Greedy outputs of every prompt served concurrently, with the engine and its metrics."""
    pool = KVPool.for_config(lm.config, num_blocks, block_size, lm.dtype)
    config = SchedulerConfig(max_sequences, lm.config.max_position_embeddings, num_blocks, block_size, budget,
                             prefix, eos_token_ids=(), cache_root=root_hash("embedded", lm.dtype))
    engine = Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=64)
    params = SamplingParams.create(max_new_tokens=new_tokens)
    streams = [engine.submit(lm.tokenizer.encode(p).ids, params) for p in prompts]
    steps = 0
    while engine.step():
        steps += 1
    outputs = []
    for s in streams:
        assert [e.index for e in s.events] == list(range(new_tokens))  # every token once, in order
        assert s.events[-1].finish.reason == "length"
        outputs.append([e.token_id for e in s.events])
    assert engine.scheduler.kv.usage == 0 and engine.load() == (0, 0)
    return outputs, engine, steps


def metric(engine, name: str) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_prefix_cache_skips_shared_prefill_and_changes_no_token(lm):
    prompts = [PREFIX + " " + s for s in SUFFIXES]
    # the first request warms the cache; the others arrive while it is cached
    off, engine_off, _ = run(lm, prompts, prefix=False)
    warm = run(lm, prompts[:1])[1]
    assert metric(warm, 'hetserve_worker_prefill_tokens_total{kind="skipped"}') == 0
    on, engine_on, _ = run(lm, prompts[:1] + prompts, max_sequences=1)  # one at a time: each finds the cache
    assert on[1:] == off
    skipped = metric(engine_on, 'hetserve_worker_prefill_tokens_total{kind="skipped"}')
    computed_on = metric(engine_on, 'hetserve_worker_prefill_tokens_total{kind="computed"}')
    computed_off = metric(engine_off, 'hetserve_worker_prefill_tokens_total{kind="computed"}')
    prefix_len = len(lm.tokenizer.encode(PREFIX).ids)
    assert skipped >= len(SUFFIXES) * (prefix_len // 16) * 16  # every request skipped the prefix's full blocks
    assert computed_on < computed_off / 2
    assert metric(engine_on, "hetserve_worker_prefix_cache_hits_tokens_total") == skipped
    assert metric(engine_on, "hetserve_worker_prefix_cache_queries_tokens_total") > skipped


def test_chunked_prefill_gives_the_unchunked_tokens(lm):
    prompts = [PREFIX + " " + s for s in SUFFIXES[:4]]
    whole, _, steps_whole = run(lm, prompts, prefix=False)
    chunked, _, steps_chunked = run(lm, prompts, prefix=False, budget=16)
    assert chunked == whole and steps_chunked > steps_whole + 10


def test_preemption_under_a_tiny_pool_completes_every_request_unchanged(lm):
    prompts = [PREFIX[: 20 * (i + 1)] + " " + s for i, s in enumerate(SUFFIXES)]
    roomy, _, _ = run(lm, prompts, prefix=False)
    longest = max(len(lm.tokenizer.encode(p).ids) for p in prompts) + NEW_TOKENS
    for prefix in (False, True):
        tight, engine, _ = run(lm, prompts, num_blocks=-(-longest // 4) + 2, block_size=4, prefix=prefix)
        assert tight == roomy
        assert engine.scheduler.num_preemptions > 0
        assert metric(engine, "hetserve_worker_preemptions_total") == engine.scheduler.num_preemptions
