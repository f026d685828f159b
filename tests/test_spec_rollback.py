"""Speculation on models whose state past the last accepted token must be undone: a hybrid's
linear-attention state (rolled back, workers/model/state_rollback.py) and sliding-window KV groups
(blocks freed as the window slides, after a rejection as after any step). Tiny random checkpoints in
deterministic mode: greedy outputs are plain decoding's bit for bit, logprobs included, while
drafts are both accepted and rejected in the same run."""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculate import Speculator, speculator_for
from workers.kv.groups import first_needed
from workers.model.deterministic import enable_deterministic
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams
from workers.spec.policy import SpecPolicy

PROMPTS = ["Once upon a time there was a little fox who lived near the river and the river",
           "def main(): print('hello') return 0 def main(): print(",
           "A heterogeneous host has GPUs of different architectures."]
NEW = 16


@pytest.fixture(scope="module", params=["qwen3_5", "gemma2"])
def lm(request, tmp_path_factory):
    torch.set_num_threads(1)
    lm = load_model(make_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param)), "float32")
    enable_deterministic(lm.model)
    return lm


def serve(lm, prompts, drafts=None):
    """Greedy outputs `[(token, logprob), ...]` per prompt, all at once, and the engine;
    `drafts(seq, kv) -> ids` replaces the proposer's drafts, `kv` the scheduler's block manager
    (None: no speculation)."""
    slots = len(prompts) if lm.config.state_layers else 0
    pool = lm.model.new_kv_pool(96, 4, state_slots=slots)
    config = SchedulerConfig(len(prompts), 512, 96, 4, 256, False, eos_token_ids=(), state_slots=slots,
                             kv_groups=pool.group_shapes)
    speculator = None
    if drafts is not None:
        speculator = Speculator("ngram", SpecPolicy(4, 8))
        original = speculator.propose

        def propose(running):
            original(running)
            for seq in running:
                if seq.output_ids and seq.num_tokens - seq.num_computed == 1:
                    seq.draft_ids = drafts(seq, engine.scheduler.kv)

        speculator.propose = propose
    engine = Engine(ModelRunner(lm.model, pool, "cpu", mirror=False), Scheduler(config), lm.tokenizer,
                    max_queue=8, speculator=speculator)
    streams = [engine.submit(lm.tokenizer.encode(p).ids, SamplingParams.create(max_new_tokens=NEW)) for p in prompts]
    while engine.step():
        pass
    assert engine.scheduler.kv.usage == 0
    return [[(e.token_id, e.logprob) for e in s.events] for s in streams], engine


def test_greedy_output_is_plain_decodings_bit_for_bit_with_drafts_accepted_and_rejected(lm):
    """Each draft: the next two tokens plain decoding gives, then two it does not, so every drafted
    step accepts two drafts and rejects the rest. Guards `recorder.rollback(...)` in
    `Speculator.step` (a hybrid's state would keep the rejected tokens) and `sched.kv.slide(seq)` in
    `Speculator._settle` (a sliding group would hold blocks its window left)."""
    plain, _ = serve(lm, PROMPTS)
    tokens = {lm.tokenizer.encode(p).ids[-1]: [t for t, _ in out] for p, out in zip(PROMPTS, plain, strict=True)}
    by_prompt = {}

    def drafts(seq, kv):
        for g, window in enumerate(kv.windows):  # a sliding group holds only its window
            if window is not None:
                table = seq.block_ids if g == 0 else seq.group_tables[g - 1]
                assert seq.held_from[g] == min(first_needed(window, seq.num_computed, 4), len(table))
        want = by_prompt.setdefault(seq.uid, tokens[seq.prompt_ids[-1]])
        n = len(seq.output_ids)
        wrong = [(t + 7) % lm.config.vocab_size for t in want[n + 2:n + 4]]
        return want[n:n + 2] + wrong

    spec, engine = serve(lm, PROMPTS, drafts)
    assert spec == plain
    assert speculator_for("ngram", 4, engine.scheduler).enabled  # nothing refuses these models any more
    described = engine.speculation()
    assert described["accepted_tokens"] > 0 and described["accepted_tokens"] < described["draft_tokens"]

