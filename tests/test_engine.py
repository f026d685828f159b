"""Engine: one batched step per iteration, streaming text, stop strings, cancellation,
seeded determinism across batch mates and backpressure — with a fake model."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.engine_fakes import EOS_ID, FakeRunner, tokenizer
from workers.contract.detokenize import IncrementalDetokenizer, special_token_ids
from workers.engine.core import Engine, EngineOverloaded, EngineUnavailable
from workers.engine.events import ErrorEvent
from workers.engine.scheduler import CapacityError, Scheduler, SchedulerConfig
from workers.sampling.params import SamplingParams

TOK = tokenizer()


def make_engine(max_sequences=4, max_seq_len=64, max_queue=4, num_blocks=64, block_size=4, budget=2048,
                **runner_kw) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(block_size=block_size, **runner_kw)
    config = SchedulerConfig(max_sequences, max_seq_len, num_blocks, block_size, budget, eos_token_ids=(EOS_ID,))
    return Engine(runner, Scheduler(config), TOK, max_queue=max_queue), runner


def run_until_idle(engine: Engine, limit=200) -> int:
    steps = 0
    while engine.step() and steps < limit:
        steps += 1
    return steps


def prompt(text="Hello world") -> list[int]:
    return TOK.encode(text).ids


def text_of(stream) -> str:
    return "".join(e.text for e in stream.events if not e.special)


# -- detokenization --------------------------------------------------------------------------


def test_streamed_pieces_never_split_a_utf8_character():
    """Guards the `full_text.endswith(REPLACEMENT_CHAR)` hold-back in `IncrementalDetokenizer.add`."""
    ids = TOK.encode("Hello €uro 日本!").ids[1:]  # '€', '日', '本' are 3 byte-tokens each here
    detok = IncrementalDetokenizer(TOK, [0], special_token_ids(TOK))
    pieces = [detok.add(t)[0] for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 4  # the first bytes of the multi-byte characters were held back
    assert "".join(pieces) == "Hello €uro 日本!" == detok.text


def test_flush_releases_an_incomplete_tail_and_special_tokens_stay_out_of_text():
    ids = TOK.encode("ok €").ids[1:-1]  # '€' cut after its second byte
    detok = IncrementalDetokenizer(TOK, [0], special_token_ids(TOK))
    pieces = [detok.add(t)[0] for t in ids]
    assert "".join(pieces) == "ok "
    assert detok.add(EOS_ID) == ("</s>", True)
    assert detok.flush() == "\ufffd" and detok.text == "ok \ufffd"


def test_stop_string_cuts_text_even_across_tokens():
    detok = IncrementalDetokenizer(TOK, [0], special_token_ids(TOK), stop=["y do"])
    pieces = [detok.add(t)[0] for t in TOK.encode("The quick brown fox jumps over the lazy dog.").ids[1:]]
    assert detok.stopped and detok.text == "The quick brown fox jumps over the lazy do"
    assert "".join(pieces) == detok.text


# -- the engine with a fake model --------------------------------------------------------------


def test_one_forward_per_step_holds_new_prefills_and_running_decodes():
    engine, runner = make_engine(max_sequences=4)
    a = engine.submit(prompt(), SamplingParams.create(max_new_tokens=3), request_id="a")
    engine.step()
    b = engine.submit(prompt("The quick"), SamplingParams.create(max_new_tokens=3), request_id="b")
    run_until_idle(engine)
    # step 2 ran a's decode and b's prefill in the same forward
    assert [(rid, n > 1) for rid, _, n, _ in runner.steps[1]] == [("a", False), ("b", True)]
    for s in (a, b):
        assert [e.index for e in s.events] == [0, 1, 2]
        fin = s.events[-1].finish
        assert fin.reason == "length" and fin.generated_tokens == 3 and fin.generated_text == text_of(s)
    assert engine.load() == (0, 0)


def test_eos_and_stop_sequence_finish_reasons():
    hello = TOK.encode("Hello world").ids[1:]
    engine, _ = make_engine(script={"s": hello}, eos_after={"e": 2})
    e = engine.submit(prompt(), SamplingParams.create(max_new_tokens=10), request_id="e")
    s = engine.submit(prompt(), SamplingParams.create(max_new_tokens=10, stop=["wor"]), request_id="s")
    run_until_idle(engine)
    assert e.events[-1].finish.reason == "eos_token" and e.events[-1].special
    assert e.events[-1].finish.generated_tokens == 2
    assert s.events[-1].finish.reason == "stop_sequence"
    assert s.events[-1].finish.generated_text == "Hello wor" == text_of(s)


def test_abort_frees_the_batch_place_and_blocks_for_the_next_step():
    engine, runner = make_engine(max_sequences=1)
    engine.submit(prompt(), SamplingParams.create(max_new_tokens=50), request_id="gone")
    waiting = engine.submit(prompt(), SamplingParams.create(max_new_tokens=2), request_id="next")
    engine.step()
    engine.step()
    engine.abort("gone")
    engine.step()
    assert [rid for rid, *_ in runner.steps[-1]] == ["next"]  # the very next step
    assert engine.scheduler.kv.num_free_blocks == 64 - 1  # only next's one block is held
    run_until_idle(engine)
    assert waiting.events[-1].finish.reason == "length"
    assert engine.load() == (0, 0)
    assert 'hetserve_worker_requests_total{finish_reason="aborted"} 1.0' in engine.metrics.render().decode()


def test_seeded_output_is_the_same_whatever_the_batch_mates():
    params = SamplingParams.create(temperature=0.8, top_k=50, seed=7, max_new_tokens=12)

    def tokens(n_mates: int) -> list[int]:
        engine, _ = make_engine(max_sequences=8, max_queue=8)
        for i in range(n_mates):
            engine.submit(prompt(f"mate {i}"), SamplingParams.create(do_sample=True, seed=i, max_new_tokens=5 + i))
        mine = engine.submit(prompt(), params)
        run_until_idle(engine)
        return [e.token_id for e in mine.events]

    alone = tokens(0)
    assert alone == tokens(3) == tokens(7)
    assert len(set(alone)) > 3  # really sampled, not a constant


def test_unseeded_sampling_reports_the_seed_it_used():
    engine, _ = make_engine()
    s = engine.submit(prompt(), SamplingParams.create(do_sample=True, max_new_tokens=2))
    g = engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))
    run_until_idle(engine)
    assert isinstance(s.events[-1].finish.seed, int) and g.events[-1].finish.seed is None


def test_bounded_queue_refuses_beyond_running_plus_queued():
    engine, _ = make_engine(max_sequences=2, max_queue=1)
    for _ in range(3):
        engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))
    with pytest.raises(EngineOverloaded) as e:
        engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))
    assert "limit 3" in str(e.value) and e.value.retry_after >= 1
    run_until_idle(engine)
    engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))  # room again


def test_side_work_is_admitted_and_counted_as_a_running_request():
    """Guards `_admit_locked()` and `_side_running` in `Engine.side_work`: a request's embeddings
    take a place of the worker's in flight (refused with the others when full) and show as running."""
    engine, _ = make_engine(max_sequences=2, max_queue=1)
    with engine.side_work():
        assert engine.load() == (1, 0)
        for _ in range(2):
            engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))
        with pytest.raises(EngineOverloaded, match="limit 3"):
            engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))
        with pytest.raises(EngineOverloaded), engine.side_work():
            pass
    assert engine.load() == (0, 2)
    run_until_idle(engine)
    assert engine.load() == (0, 0)


def test_request_over_capacity_is_refused_before_queueing():
    engine, _ = make_engine(max_seq_len=16)
    with pytest.raises(CapacityError, match="<= 16"):
        engine.submit(prompt(), SamplingParams.create(max_new_tokens=100))
    assert engine.load() == (0, 0)


def test_threaded_engine_streams_to_asyncio_and_shutdown_fails_leftovers():
    engine, _ = make_engine(max_sequences=4, max_queue=8, delay=0.002)
    engine.start()

    async def consume(max_new: int):
        stream = engine.submit(prompt(), SamplingParams.create(max_new_tokens=max_new), asyncio.get_running_loop())
        return [e async for e in stream]

    async def main():
        return await asyncio.gather(*(consume(n) for n in (3, 5, 8, 2, 6)))

    results = asyncio.run(main())
    assert [len(r) for r in results] == [3, 5, 8, 2, 6]
    assert all(r[-1].finish is not None for r in results)

    async def leftover():
        stream = engine.submit(prompt(), SamplingParams.create(max_new_tokens=60), asyncio.get_running_loop())
        events = []
        async for e in stream:
            events.append(e)
            if len(events) == 2:
                await asyncio.to_thread(engine.shutdown, 0.0)
        return events

    events = asyncio.run(leftover())
    assert isinstance(events[-1], ErrorEvent) and "shut down" in events[-1].message
    with pytest.raises(EngineUnavailable):
        engine.submit(prompt(), SamplingParams.create(max_new_tokens=2))


def test_an_idle_engine_runs_the_first_step_on_the_submitting_thread():
    """Guards `Engine._first_step_here`: a request reaching an idle engine is stepped at once on
    the caller's thread (no hand-off to the engine thread); the engine thread takes over for
    the steps after, and a request arriving while others run queues for the engine thread."""
    engine, runner = make_engine(max_sequences=4, delay=0.002)
    engine.start()

    async def main():
        loop = asyncio.get_running_loop()
        one = engine.submit(prompt(), SamplingParams.create(max_new_tokens=1), loop)
        assert runner.threads == ["MainThread"]  # done before submit() returned
        first = [e async for e in one]
        long = engine.submit(prompt("The quick"), SamplingParams.create(max_new_tokens=6), loop)
        assert runner.threads[-1] == "MainThread"
        busy = engine.submit(prompt("Hello"), SamplingParams.create(max_new_tokens=2), loop)
        return first, [e async for e in long], [e async for e in busy]

    first, long, busy = asyncio.run(main())
    engine.shutdown()
    assert first[-1].finish.generated_tokens == 1 and long[-1].finish.generated_tokens == 6
    assert busy[-1].finish.generated_tokens == 2
    assert runner.threads.count("MainThread") == 2 and runner.threads[2:] == ["engine"] * (len(runner.threads) - 2)
    assert any(rid == "req-3" for step in runner.steps[2:] for rid, *_ in step)


def _engine_idle(engine) -> bool:
    """No thread holds the engine's step lock and nothing is left to step."""
    if not engine._step_lock.acquire(blocking=False):
        return False
    engine._step_lock.release()
    return not engine.scheduler.has_unfinished()


def test_a_long_prompt_reaching_an_idle_engine_is_prefilled_on_the_engine_thread():
    """Guards `seq.num_tokens > INLINE_MAX_TOKENS` in `Engine._first_step_here`: a prompt longer than
    that is not stepped on the caller's thread (its prefill would hold the caller's event loop,
    and every request arriving behind it, for the whole step); a short one still is."""
    from workers.engine.core import INLINE_MAX_TOKENS

    engine, runner = make_engine(max_sequences=4, max_seq_len=INLINE_MAX_TOKENS + 8, delay=0.002)
    engine.start()

    async def main():
        loop = asyncio.get_running_loop()
        long = engine.submit(prompt(" ".join(["word"] * 4 * INLINE_MAX_TOKENS))[: INLINE_MAX_TOKENS + 1],
                             SamplingParams.create(max_new_tokens=1), loop)
        first = [e async for e in long]
        # the long one's last event can arrive while the engine thread still ends its step: wait until idle
        deadline = time.monotonic() + 5
        while not _engine_idle(engine) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        short = engine.submit(prompt()[:INLINE_MAX_TOKENS], SamplingParams.create(max_new_tokens=1), loop)
        return first, [e async for e in short]

    first, short = asyncio.run(main())
    engine.shutdown()
    assert first[-1].finish.generated_tokens == 1 and short[-1].finish.generated_tokens == 1
    assert runner.threads == ["engine", "MainThread"]


def test_model_failure_is_fatal_and_every_request_gets_an_error():
    class Broken:
        def execute(self, out):
            raise RuntimeError("device lost")

    fatal = []
    sched = Scheduler(SchedulerConfig(2, 64, 32, eos_token_ids=(EOS_ID,)))
    engine = Engine(Broken(), sched, TOK, max_queue=4, on_fatal=fatal.append)

    async def main():
        loop = asyncio.get_running_loop()
        streams = [engine.submit(prompt(), SamplingParams.create(max_new_tokens=4), loop) for _ in range(3)]
        engine.start()  # the three wait in the inbox; the engine thread's first step fails
        return [[e async for e in s] for s in streams]

    results = asyncio.run(main())
    assert all(len(r) == 1 and isinstance(r[0], ErrorEvent) and "device lost" in r[0].message for r in results)
    with pytest.raises(EngineUnavailable):
        engine.submit(prompt(), SamplingParams.create(max_new_tokens=4))
    engine.shutdown()  # joins the (already ended) engine thread
    assert len(fatal) == 1 and engine.fatal_error is fatal[0] and not engine.accepting
    assert engine.load() == (0, 0)


# -- stop strings cut off, structured output -----------------------------------------------------


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", "ab ab abc ab abc"])
def test_a_stop_string_cut_off_is_never_streamed_in_part(text):
    """Guards `_append_without_stop`'s hold-back: OpenAI's `stop` must not show in the output,
    not even its first characters in an earlier streamed piece."""
    stops = ["y do", "abc"]
    detok = IncrementalDetokenizer(TOK, [0], special_token_ids(TOK), stop=stops, stop_in_text=False)
    pieces = [detok.add(t)[0] for t in TOK.encode(text).ids[1:]]
    cut = min(i for i in (text.find(s) for s in stops) if i >= 0)
    assert detok.stopped and detok.text == text[:cut] == "".join(pieces)
    kept = IncrementalDetokenizer(TOK, [0], special_token_ids(TOK), stop=["zz!"], stop_in_text=False)
    pieces = [kept.add(t)[0] for t in TOK.encode("fizz buzz z").ids[1:]]
    assert not kept.stopped and "".join(pieces) + kept.flush() == "fizz buzz z" == kept.text


def test_a_constrained_request_ends_when_its_grammar_is_complete():
    """The fake model never emits EOS by itself: the grammar's completion ends the request
    (guards the `advance(...)` finish in `Engine._events`)."""
    from workers.sampling.grammar import Grammars, GrammarSpec, json_text

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    spec = GrammarSpec("json_schema", json_text(schema))
    engine, _ = make_engine()
    engine.grammars = Grammars.for_tokenizer(TOK, None, (EOS_ID,))
    params = SamplingParams.create(max_new_tokens=40, grammar=spec)
    with pytest.raises(ValueError, match="compiled"):
        engine.submit(prompt(), params)
    constrained = engine.submit(prompt(), params, grammar=engine.grammars.compile(spec))
    plain = engine.submit(prompt(), SamplingParams.create(max_new_tokens=5))
    run_until_idle(engine)
    fin = constrained.events[-1].finish
    assert fin.reason == "eos_token" and fin.generated_text in ('{"ok":true}', '{"ok":false}')
    assert plain.events[-1].finish.generated_tokens == 5


def test_stream_batches_hand_over_what_arrived_together_and_end_at_the_finish():
    """Guards `RequestStream.batches`: events delivered while the reader was away come in one
    list (one write of the streamed response), and the list stops at the finish."""
    from workers.engine.events import FinishInfo, RequestStream, TokenEvent

    async def main():
        stream = RequestStream("r", asyncio.get_running_loop())
        finish = FinishInfo("length", "abc", 3, 1, None)
        for i, f in enumerate((None, None, finish)):
            stream.push(TokenEvent(i, 10 + i, "x", -0.5, False, f))
        stream.push(TokenEvent(9, 99, "late", -0.5, False))  # nothing after the finish is read
        return [[e.index for e in batch] async for batch in stream.batches()]

    assert asyncio.run(main()) == [[0, 1, 2]]
