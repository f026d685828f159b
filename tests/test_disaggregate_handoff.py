"""The router's side of a split prefill and of a short answer kept on its prefill worker
(server/dispatch/handoff.py `_open_part`, `_prefill_part`, `_open_here`), against a scripted
dispatcher: what each worker is sent, where, and what the client's stream and the counters say;
a partial prefill that fails or outlasts `--disaggregate-timeout` only leaves more to compute on
the decode worker. (The data path, engine to engine through the tier at every block boundary, is
tests/test_disaggregate_engine.py's.)"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

import anyio
import pytest
from prometheus_client import CollectorRegistry

from server.dispatch.dispatcher import DispatchError, WorkerStream
from server.dispatch.handoff import Disaggregation
from server.fleet.client import SSEEvents
from server.routing.filter import Constraints
from server.routing.roles import BOTH, DECODE, PREFILL, Roles
from server.routing.split import PART, WHOLE, Split
from workers.contract import WorkerRequest

IDS = tuple(range(100, 200))  # a 100-token prompt


@dataclass
class Handle:
    id: str
    generation: int = 1


def _stream(worker: Handle, events: list[dict]) -> WorkerStream:
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)

    async def nothing():
        return
        yield

    return WorkerStream(worker, {}, raw, json.dumps(events[-1]), SSEEvents(nothing()), contextlib.AsyncExitStack())


class Scripted:
    """A dispatcher whose `open_stream` answers from `answers` (worker id -> events, a
    DispatchError, or "hang") for the one worker the exclusion leaves, recording each call."""

    def __init__(self, answers: dict):
        self.workers = {w: Handle(w) for w in ("gpu0", "gpu1")}
        self.supervisor = self
        self.answers, self.calls = answers, []

    async def open_stream(self, path, body, c, exclude=None, deaths=None, wait=True):
        (target,) = [w for w in self.workers if w not in (exclude or {})]
        self.calls.append((target, body))
        answer = self.answers[target]
        if answer == "hang":
            await anyio.sleep(60)
        if isinstance(answer, DispatchError):
            raise answer
        return _stream(self.workers[target], answer)


TOKEN = {"token": {"id": 7, "text": "a", "logprob": -0.1, "special": False}, "generated_text": None, "details": None}
LAST = {"token": {"id": 8, "text": "b", "logprob": -0.2, "special": False}, "generated_text": "ab",
        "details": {"finish_reason": "length", "generated_tokens": 1}}


def _disagg(timeout_s: float = 5.0) -> Disaggregation:
    roles = Roles({"gpu1": PREFILL, "gpu0": DECODE}, "explicit roles")
    return Disaggregation(roles, 16, 8, CollectorRegistry(), timeout_s=timeout_s)


def _body() -> WorkerRequest:
    return WorkerRequest.model_validate({"inputs": "x " * 99, "stream": True,
                                        "parameters": {"max_new_tokens": 12, "stop": ["zz"]}})


def _count(counter, label: str) -> float:
    return counter.labels(label)._value.get()


@pytest.mark.anyio
async def test_a_split_sends_whole_blocks_of_the_prompt_to_one_worker_and_the_request_to_the_other():
    """Guards the part's body in `_open_part`: the first k ids only, one token, published; then
    the request as the client sent it, on the decode worker, whose stream the client gets."""
    d, dispatcher = _disagg(), Scripted({"gpu1": [LAST], "gpu0": [TOKEN]})
    split = Split(PART, "gpu1", "gpu0", 48, 0.3, "48 of 100 prompt tokens on gpu1 while gpu0 is busy")
    out = await d._open_part(dispatcher, "/generate_stream", _body(), Constraints(), IDS, split)
    (first, part), (second, whole) = dispatcher.calls
    assert (first, second) == ("gpu1", "gpu0")
    assert part.input_ids == IDS[:48] and part.inputs == "" and part.publish_kv
    assert part.parameters.max_new_tokens == 1 and tuple(part.parameters.stop) == ("zz",)
    assert whole == _body()  # nothing of the part's changes reaches the decode worker's request
    assert out.worker.id == "gpu0"
    assert out.headers["x-hetserve-route"].startswith(
        "disaggregated: 48 of 100 prompt tokens prefilled on gpu1, the rest and the decode on gpu0")
    assert _count(d.requests, "split") == 1 and _count(d.fallbacks, "prefill_timeout") == 0
    await out.stream.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(("answer", "reason"), [("hang", "prefill_timeout"),
                                                (DispatchError(503, "gone", "unavailable"), "prefill_unavailable"),
                                                ([{"error": "boom", "error_type": "internal"}], "prefill_lost")])
async def test_a_part_that_fails_leaves_the_whole_prompt_to_the_decode_worker(answer, reason):
    """Guards `_prefill_part`'s bound and its fallbacks: the request still opens on gpu0 (which
    then computes the whole prompt), the route says the part was not prefilled, the reason counted."""
    d, dispatcher = _disagg(timeout_s=0.2), Scripted({"gpu1": answer, "gpu0": [TOKEN]})
    split = Split(PART, "gpu1", "gpu0", 48, 0.3, "why")
    with anyio.fail_after(10):
        out = await d._open_part(dispatcher, "/generate_stream", _body(), Constraints(), IDS, split)
    assert out.worker.id == "gpu0" and "48 of 100 prompt tokens not prefilled" in out.headers["x-hetserve-route"]
    assert _count(d.fallbacks, reason) == 1
    await out.stream.aclose()


@pytest.mark.anyio
async def test_a_short_answer_runs_whole_on_its_prefill_worker_with_nothing_published():
    """Guards `_open_here`: the client's own request (no `publish_kv`), only on the prefill worker."""
    roles = Roles({"gpu1": BOTH, "gpu0": DECODE}, "auto")
    d = Disaggregation(roles, 16, 8, CollectorRegistry())
    dispatcher = Scripted({"gpu1": [TOKEN], "gpu0": [TOKEN]})
    split = Split(WHOLE, "gpu1", None, 100, 0.1, "its 4 new tokens cost gpu1 4 ms there, less than a handoff", True)
    out = await d._open_here(dispatcher, "/generate_stream", _body(), Constraints(), split)
    assert [(w, b.publish_kv) for w, b in dispatcher.calls] == [("gpu1", False)]
    assert out.headers["x-hetserve-route"].startswith("disaggregated: prefill and decode on gpu1")
    assert _count(d.requests, "decoded_on_prefill") == 1
    await out.stream.aclose()
