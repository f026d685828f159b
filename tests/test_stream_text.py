"""The router builds a stream's text (server/fleet/text.py) from the token ids a real worker sends
on its channel, and the client gets byte for byte what the worker's own `/generate_stream` would
have sent: stop strings (kept or cut, spanning tokens, after `min_tokens`), special tokens,
logprobs with bytes, prompt entries, `return_full_text`, prompts given as ids, resumed streams.
A stop string found in the router ends the stream there and aborts the worker's request."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.fleet.channel import ChannelStream
from server.fleet.client import SSEEvents, WorkerClient
from server.fleet.text import StreamText
from tests.test_stream_channel import _generated, _idle
from tests.test_worker_process import ready_worker
from workers.contract import WorkerRequest
from workers.contract.events import ErrorEvent, FinishInfo, StreamStart, TokenEvent, decode_batch, encode_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    # no prefix cache: each request of a pair computes its prompt alike (a cached prefix may move a
    # near-tie of the random model's logits), so the pair differs only in who renders it
    with ready_worker(tmp_path_factory.mktemp("text"), "--max-batch", "4", "--kv-block-size", "8",
                      "--no-prefix-cache") as w:
        yield w


async def _stream(c: WorkerClient, body: dict) -> tuple[bool, list[dict]]:
    async with c.stream("/generate_stream", WorkerRequest.model_validate(body)) as response:
        assert response.status_code == 200, await response.read()
        on_ids = isinstance(response, ChannelStream) and response._text is not None
        return on_ids, [json.loads(data) async for data in SSEEvents(response.iter_chunks()).events()]


def _both(sock, bodies: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """Each body streamed through the router's text (an ids channel) and by the worker itself."""

    async def run():
        routed, alone = WorkerClient(sock), WorkerClient(sock, channel=False)
        try:
            out = []
            for body in bodies:
                on_ids, mine = await _stream(routed, body)
                assert on_ids, "the stream did not go on a channel of token ids"
                _, theirs = await _stream(alone, body)
                out.append((mine, theirs))
            return out
        finally:
            await routed.aclose()
            await alone.aclose()

    return asyncio.run(run())


def _same(mine, theirs) -> bool:
    """`mine` equals `theirs` field for field, a float within 1e-5: the text, ids, finish and every
    other field exactly, while a logprob may differ in its last bits when the two requests' first
    steps ran on different threads of the worker (an idle engine's first step runs inline)."""
    if isinstance(mine, float) and isinstance(theirs, float):
        return abs(mine - theirs) <= 1e-5
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(_same(a, b) for a, b in zip(mine, theirs, strict=True))
    return mine == theirs


def _plain(sock, prompt: str, n: int) -> str:
    [(events, _)] = _both(sock, [{"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True}}])
    return events[-1]["generated_text"]


def test_the_router_renders_what_the_worker_would(worker):
    """Every parameter that shapes a stream's text gives the same events whichever side renders."""
    sock = worker["sock"]
    text = _plain(sock, "Once upon a time", 24)
    middle = text[len(text) // 3: len(text) // 3 + 3]  # spans tokens more often than not
    assert middle.strip(), text
    greedy = {"max_new_tokens": 24, "details": True}
    bodies = [
        {"inputs": "Once upon a time", "parameters": {**greedy, "stop": [middle]}},
        {"inputs": "Once upon a time", "parameters": {**greedy, "stop": [middle], "include_stop_str_in_output": False}},
        {"inputs": "Once upon a time", "parameters": {**greedy, "stop": [middle], "min_tokens": 20}},
        {"inputs": "Once upon a time", "parameters": {**greedy, "top_n_tokens": 3, "skip_special_tokens": False}},
        {"inputs": "The quick brown fox", "parameters": {**greedy, "decoder_input_details": True,
                                                         "prompt_top_n_tokens": 2, "return_full_text": True}},
        {"input_ids": [5, 17, 99, 3, 42], "parameters": {**greedy, "return_full_text": True}},
        {"inputs": "Hello", "parameters": {"max_new_tokens": 12, "details": True, "do_sample": True, "seed": 7,
                                           "temperature": 0.9}},
    ]
    for body, (mine, theirs) in zip(bodies, _both(sock, bodies), strict=True):
        assert _same(mine, theirs), (body, mine, theirs)
    # the stop string really ended those streams, in the router
    first = _both(sock, bodies[:2])
    for mine, _ in first:
        assert mine[-1]["details"]["finish_reason"] == "stop_sequence"
        assert mine[-1]["details"]["stop_reason"] == middle
    assert first[0][0][-1]["generated_text"].endswith(middle)
    assert middle not in first[1][0][-1]["generated_text"]


def test_a_resumed_stream_goes_on_in_the_same_text(worker):
    """`resume_ids` replayed through the router's detokenizer: the text after them is the same as
    the worker's own, which replays them through its engine's."""
    sock = worker["sock"]
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 16, "details": True}}
    [(full, _)] = _both(sock, [body])
    resumed = {**body, "resume_ids": [e["token"]["id"] for e in full[:6]]}
    [(mine, theirs)] = _both(sock, [resumed])
    assert _same(mine, theirs), (mine, theirs)
    assert [e["index"] for e in mine] == list(range(6, 16))
    assert mine[-1]["generated_text"] == full[-1]["generated_text"]


def test_a_stop_string_found_in_the_router_frees_the_worker(worker):
    """Guards the abort of a stream whose text ended in the router (`ChannelStream._done` stays
    False, so `aclose` aborts it): the worker would otherwise decode all 200 tokens."""
    sock = worker["sock"]
    text = _plain(sock, "Hello", 8)
    stop = text[2:5]
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 200, "ignore_eos": True, "stop": [stop]}}

    async def run():
        c = WorkerClient(sock)
        try:
            _, events = await _stream(c, body)
            await asyncio.sleep(0.3)  # the abort goes out on the next loop iteration
            return events
        finally:
            await c.aclose()

    before = _generated(sock)
    events = asyncio.run(run())
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert _idle(sock)["load"] == {"running": 0, "queued": 0}
    assert _generated(sock) - before < 100  # stopped after a few tokens, not run to its 200


def test_records_round_trip_and_junk_is_a_value_error():
    """The channel's binary form keeps every field the router renders from."""
    finish = FinishInfo("stop_sequence", "", 3, 7, 11, None, 2)
    prefill = ((1, None, None), (2, -3.0, ((2, -3.0),)))
    events = [TokenEvent(0, 5, "", -0.5, False, None, ((5, -0.5), (6, -1.25)), prefill),
              TokenEvent(1, 2, "", float("-inf"), True, finish), ErrorEvent("boom", "internal")]
    start, back = decode_batch(encode_batch(events, StreamStart((1, 2), 7, 11)))
    assert start == StreamStart((1, 2), 7, 11)
    assert back == events
    with pytest.raises(ValueError, match="not a stream channel record"):
        decode_batch(b"\x93junk")


def test_a_first_record_without_its_start_is_refused():
    """A stream's text cannot begin without the prompt's tail: a clear error, not a wrong text."""
    text = StreamText(model=None, request=WorkerRequest(inputs="x"))
    with pytest.raises(ValueError, match="no start"):
        text.feed(None, [TokenEvent(0, 1, "", 0.0, False)])


def test_a_non_streamed_answer_is_built_in_the_router_as_the_worker_would(worker):
    """`/generate` goes on the channel (the router builds its body from token ids) and answers
    what the worker's own `/generate` does, refusals included; prompt scoring stays the worker's."""
    sock = worker["sock"]
    bodies = [
        {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "details": True, "stop": ["e"]}},
        {"inputs": "Hello", "parameters": {"max_new_tokens": 6, "details": True, "top_n_tokens": 2,
                                           "decoder_input_details": True, "return_full_text": True}},
        {"input_ids": [5, 17, 99], "parameters": {"max_new_tokens": 4}},
        {"inputs": "Hello", "parameters": {"max_new_tokens": 300}},  # refused: 422 from the worker
        {"input_ids": [5, 17, 99], "parameters": {"max_new_tokens": 0, "decoder_input_details": True}},
    ]

    async def run():
        routed, alone = WorkerClient(sock), WorkerClient(sock, channel=False)
        try:
            out = []
            for body in bodies:
                request = WorkerRequest.model_validate(body)
                mine, theirs = await routed.post("/generate", request), await alone.post("/generate", request)
                out.append((mine, theirs))
            return out, routed._channel
        finally:
            await routed.aclose()
            await alone.aclose()

    answers, channel = asyncio.run(run())
    assert channel is not None and channel.text is not None  # the first request opened an ids channel
    for body, ((status, _, content), (their_status, _, their_content)) in zip(bodies, answers, strict=True):
        assert status == their_status, body
        assert json.loads(content) == json.loads(their_content), body
    assert answers[0][0][0] == 200 and answers[3][0][0] == 422
