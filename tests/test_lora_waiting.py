"""Requests for an adapter with every `--max-loras` slot in use wait inside the worker for one
(workers/lora/waiting.py): admitted, not refused; the requests behind them start meanwhile; each
runs with its own adapter once a slot frees; one whose adapter is unloaded while it waits ends with
an error naming the adapter."""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter
from tests.test_compiled_step import make_engine
from workers.contract import WorkerConfig
from workers.engine.events import ErrorEvent, TokenEvent
from workers.lora.metrics import lora_load
from workers.lora.worker import install_loras
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

pytest.importorskip("peft")
NEW = 6


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """An engine over the llama case with adapters `a` and `b` and one slot; a prompt."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lora-wait")
    base = make_family_checkpoint("llama", tmp / "base")
    a, b = make_adapter(base, tmp / "a", 1, std=0.3), make_adapter(base, tmp / "b", 2, std=0.3)
    lm = load_model(base, "float32")
    engine = make_engine(lm, None)
    install_loras(engine, WorkerConfig(socket="/tmp/unused.sock", lora=f"a={a},b={b}", max_loras=1), lm, "cpu")
    prompt = lm.tokenizer.encode("Once upon a time there was a little fox who lived near the river").ids
    return engine, prompt, {"a": a, "b": b}


def _tokens(stream) -> list[int]:
    return [e.token_id for e in stream.events if isinstance(e, TokenEvent)]


def _alone(engine, prompt, lora) -> list[int]:
    stream = engine.submit(prompt, SamplingParams.create(max_new_tokens=NEW), lora=lora)
    while engine.step():
        pass
    return _tokens(stream)


def test_a_request_waits_for_a_slot_and_the_ones_behind_it_start(one_slot):
    """Guards `acquire_or_wait`'s `except LoraSlotsFull` (without it `submit` refuses `b` with a 429)
    and the scheduler's skip of a sequence whose `take_slot` is False (without it `b` runs on the base
    model, or blocks the base request behind it until `a` ends)."""
    engine, prompt, _ = one_slot
    want = {lora: _alone(engine, prompt, lora) for lora in ("a", "b", None)}
    assert len({tuple(t) for t in want.values()}) == 3, "the adapters must change the tokens for this test"
    params = SamplingParams.create(max_new_tokens=NEW)
    streams = {lora: engine.submit(prompt, params, lora=lora) for lora in ("a", "b", None)}
    engine.step()  # `a` holds the one slot (b's slot went to a at submit): b waits, the base row starts
    assert streams[None].events and streams["a"].events and not streams["b"].events
    assert lora_load(engine.scheduler).waiting == ("b",)
    while engine.step():
        pass
    assert {lora: _tokens(s) for lora, s in streams.items()} == want
    assert engine.load() == (0, 0)


def test_a_waiting_request_whose_adapter_is_unloaded_ends_with_an_error(one_slot):
    """Guards `take_slot`'s `except LoraError` (the error and the abort): without it an unloaded
    adapter's waiting request raises inside the step, a fatal engine error for every request."""
    engine, prompt, paths = one_slot
    params = SamplingParams.create(max_new_tokens=NEW)
    first = engine.submit(prompt, params, lora="a")
    waiting = engine.submit(prompt, params, lora="b")
    engine.loras.unregister("b")
    try:
        while engine.step():
            pass
    finally:
        engine.loras.register("b", paths["b"], load=False)
    assert len(_tokens(first)) == NEW and engine.fatal_error is None
    assert len(waiting.events) == 1 and isinstance(waiting.events[0], ErrorEvent)
    assert "`b`" in waiting.events[0].message
    assert engine.load() == (0, 0)
