"""A worker taking over a stream (`resume_ids`) and reporting its engine's liveness, with a fake
model: the continuation is what the original would have sent from that token on."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from tests.engine_fakes import FakeRunner, tokenizer
from tests.test_worker_api import INFO, sse_events
from workers.engine.core import Engine
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.sampling.params import ParameterError, SamplingParams
from workers.serving.app import create_app

TOK = tokenizer()


def make_engine(max_sequences=4, **runner_kw) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(**runner_kw)
    runner.vocab_size = runner.vocab  # what `ModelRunner` reads from the model config
    return Engine(runner, Scheduler(SchedulerConfig(max_sequences, 64)), TOK, max_queue=4), runner


def run(params: SamplingParams, resume=(), prompt="Hello world", **runner_kw):
    engine, runner = make_engine(**runner_kw)
    stream = engine.submit(TOK.encode(prompt).ids, params, request_id="r", resume_ids=resume)
    while engine.step():
        pass
    return stream.events, runner


@pytest.mark.parametrize("params", [
    SamplingParams.create(max_new_tokens=12),
    SamplingParams.create(max_new_tokens=12, temperature=0.8, top_k=40, seed=11),
    SamplingParams.create(max_new_tokens=12, repetition_penalty=1.3),
], ids=["greedy", "seeded", "penalty"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_request_goes_on_exactly_as_the_original(params, cut):
    """Guards `make_generator(seed, skip=...)` and `replay`: without the skip a seeded
    continuation draws from the start of its generator; without the replay indices, counts and
    the final text restart from zero."""
    original, _ = run(params)
    ids = [e.token_id for e in original]
    resumed, runner = run(params, resume=ids[:cut])
    assert [e.token_id for e in resumed] == ids[cut:]
    assert [e.index for e in resumed] == list(range(cut, 12))
    assert [e.text for e in resumed] == [e.text for e in original[cut:]]
    done, ref = resumed[-1].finish, original[-1].finish
    assert (done.generated_tokens, done.input_length, done.generated_text, done.seed, done.reason) == \
           (ref.generated_tokens, ref.input_length, ref.generated_text, ref.seed, ref.reason)
    # One prefill over prompt + resumed tokens, then decodes.
    assert runner.steps[0][0][2] == len(TOK.encode("Hello world").ids) + cut


def test_a_character_split_at_the_migration_point_and_a_stop_string_across_it_come_out_whole():
    """Guards the detokenizer replay in `workers/engine/resume.py`: without it the continuation's first
    piece loses the held-back bytes of '€' and the stop string spanning the cut is missed."""
    script = TOK.encode("ab €uro stop here and more").ids[1:]
    euro_start = next(i for i in range(1, len(script)) if "€" in TOK.decode(script[:i + 1])
                      and "€" not in TOK.decode(script[:i]))
    params = SamplingParams.create(max_new_tokens=len(script), stop=["stop h"])
    original, _ = run(params, script={"r": script})
    for cut in (euro_start - 1, euro_start):  # inside the 3 bytes of '€'
        resumed, _ = run(params, resume=script[:cut], script={"r": script})
        assert "".join(e.text for e in original[:cut]) + "".join(e.text for e in resumed) == "ab €uro stop h"
        assert resumed[-1].finish.reason == "stop_sequence" and resumed[-1].finish.generated_text == "ab €uro stop h"
    stop_at = len(TOK.encode("ab €uro sto").ids[1:])  # "stop h" straddles this cut
    resumed, _ = run(params, resume=script[:stop_at], script={"r": script})
    assert resumed[-1].finish.reason == "stop_sequence" and resumed[-1].finish.generated_text == "ab €uro stop h"


@pytest.mark.parametrize(("resume", "needle"), [
    ([5] * 12, "`resume_ids` holds 12 tokens: `max_new_tokens` (12) must leave at least one"),
    ([5, 512], "`resume_ids` holds `512`, not a token id. Accepted: integers in [0, 512)"),
    ([-1], "`resume_ids` holds `-1`"),
])
def test_bad_resume_ids_are_refused_by_name(resume, needle):
    engine, _ = make_engine()
    with pytest.raises(ParameterError) as e:
        engine.submit([1, 2], SamplingParams.create(max_new_tokens=12), resume_ids=resume)
    assert needle in str(e.value)
    assert engine.load() == (0, 0)  # nothing was queued


def test_the_worker_api_resumes_a_stream_and_refuses_bad_ids_with_422():
    runner = FakeRunner()
    runner.vocab_size = runner.vocab
    engine = Engine(runner, Scheduler(SchedulerConfig(2, 64)), TOK, max_queue=1)
    with TestClient(create_app(INFO, engine, TOK, drain_timeout=1.0)) as client:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 6, "details": True}}
        original = sse_events(client.post("/generate_stream", json=body).text)
        ids = [e["token"]["id"] for e in original]
        resumed = sse_events(client.post("/generate_stream", json={**body, "resume_ids": ids[:4]}).text)
        assert resumed == original[4:]
        for bad in (["7"], [True], [10**6]):
            r = client.post("/generate_stream", json={**body, "resume_ids": bad})
            assert r.status_code == 422 and "resume_ids" in r.json()["error"], r.text


def test_liveness_tells_a_stalled_engine_from_an_idle_one():
    """Guards `LivenessClock`: /health's `engine.last_step_age_s` grows only while work is
    pending and no step completes."""
    engine, _ = make_engine()
    idle = engine.liveness()
    assert not idle.pending and idle.last_step_age_s == 0.0 and idle.steps == 0
    time.sleep(0.05)
    engine.submit([1, 2], SamplingParams.create(max_new_tokens=3))
    arrived = engine.liveness()
    assert arrived.pending and arrived.last_step_age_s < 0.05  # counted from the arrival, not the old step
    time.sleep(0.1)
    assert engine.liveness().last_step_age_s >= 0.1  # work waits and no step runs: the age grows
    engine.step()
    stepped = engine.liveness()
    assert stepped.pending and stepped.last_step_age_s < 0.05 and stepped.steps == 1
    while engine.step():
        pass
    assert engine.liveness().pending is False
    with TestClient(create_app(INFO, engine, TOK, drain_timeout=1.0)) as client:
        body = client.get("/health").json()
        assert body["engine"] == {"pending": False, "last_step_age_s": 0.0, "steps": 3}


def test_a_constrained_stream_resumes_inside_its_grammar():
    """Guards the grammar replay in `workers/engine/resume.py`: without it the continuation's grammar
    starts from scratch, so its next token must open a new object mid-way through the first."""
    from tokenizers import Tokenizer

    from workers.contract import DEFAULT_MODEL_DIR
    from workers.sampling.grammar import Grammars, GrammarSpec, json_text

    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    grammars = Grammars.for_tokenizer(tok, 4096, (2,))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json_text(schema))
    params = SamplingParams.create(max_new_tokens=40, temperature=1.5, seed=3, grammar=spec)

    def events(resume=()):
        runner = FakeRunner(vocab=4096)
        runner.vocab_size = 4096
        engine = Engine(runner, Scheduler(SchedulerConfig(2, 128, eos_token_ids=(2,))), tok, max_queue=2,
                        grammars=grammars)
        stream = engine.submit(tok.encode("x").ids, params, request_id="r", grammar=grammars.compile(spec),
                               resume_ids=resume)
        while engine.step():
            pass
        return stream.events

    original = events()
    ids = [e.token_id for e in original]
    assert len(ids) > 6
    resumed = events(ids[:5])
    assert [e.token_id for e in resumed] == ids[5:]
    assert resumed[-1].finish.generated_text == original[-1].finish.generated_text
    assert set(json.loads(original[-1].finish.generated_text)) == {"name", "n"}


def test_steps_held_on_purpose_are_no_stall():
    """Guards `and not self.held` in `LivenessClock.read`: while a compile behind the serving
    holds the steps (`Engine.steps_held`), pending work with no step is no stall; once resumed,
    the age counts from the resumption, not from the last step before the hold."""
    import time

    from workers.engine.liveness import LivenessClock

    clock = LivenessClock()
    clock.work_arrived()
    clock.held = True
    time.sleep(0.05)
    assert clock.read(pending=True).last_step_age_s == 0.0
    clock.resumed()
    assert not clock.held and clock.read(pending=True).last_step_age_s < 0.05
