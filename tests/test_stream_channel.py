"""The router's engine channel to a real worker process (workers/serving/engine_channel.py,
workers/serving/channel.py, server/fleet/channel.py): streams multiplexed on one connection
carry what a stream of its own would, a stream closed early or a channel that breaks aborts
the worker's requests, refusals come back typed with the HTTP route's status and message,
frames are read whole however they are cut, the HTTP form's bad channel headers get a clear
error, and a worker with an idle channel stops at once."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from server.fleet.channel import ChannelStream, WorkerChannel
from server.fleet.client import SSEEvents, WorkerClient
from server.fleet.uds_http import WorkerConnectionLost
from tests.test_worker_process import client, ready_worker
from workers.contract import HEADER_CHANNEL, HEADER_STREAM_KEY, WorkerRequest
from workers.contract.channel import (
    Abort,
    Admitted,
    Open,
    Opened,
    Rejected,
    Step,
    Submit,
    channel_socket_path,
    frame,
    frame_length,
    to_router,
    to_worker,
)

pytestmark = pytest.mark.slow

PROMPTS = ["Hello", "The quick brown fox", "Once upon a time there was", "def main():"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with ready_worker(tmp_path_factory.mktemp("channel"), "--max-batch", "4", "--kv-block-size", "8") as w:
        yield w


def _body(prompt: str, n: int = 10, **params) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True, **params}}


async def _events(c: WorkerClient, body: dict) -> tuple[type, list[dict]]:
    async with c.stream("/generate_stream", WorkerRequest.model_validate(body)) as response:
        assert response.status_code == 200
        return type(response), [json.loads(data) async for data in SSEEvents(response.iter_chunks()).events()]


def _generated(sock) -> float:
    with client(sock) as c:
        lines = c.get("/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("hetserve_worker_generated_tokens_total"))


def _idle(sock) -> dict:
    """The worker's health once nothing runs or waits (within 5 s)."""
    with client(sock) as c:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            health = c.get("/health").json()
            if health["load"] == {"running": 0, "queued": 0}:
                break
            time.sleep(0.02)
    return health


def test_streams_on_one_channel_carry_what_their_own_streams_would(worker):
    """Four concurrent streams share one channel and each gets the same events, in order and
    complete, as the same request streamed on a connection of its own."""

    async def run():
        on_channel, alone = WorkerClient(worker["sock"]), WorkerClient(worker["sock"], channel=False)
        try:
            shared = await asyncio.gather(*(_events(on_channel, _body(p, ignore_eos=True)) for p in PROMPTS))
            own = [await _events(alone, _body(p, ignore_eos=True)) for p in PROMPTS]
            channel = on_channel._channel
        finally:
            await on_channel.aclose()
            await alone.aclose()
        return shared, own, channel

    shared, own, channel = asyncio.run(run())
    assert channel is not None and channel.id.startswith("c")
    for (kind, events), (own_kind, own_events) in zip(shared, own, strict=True):
        assert kind is ChannelStream and own_kind is not ChannelStream
        assert [e["token"]["id"] for e in events] == [e["token"]["id"] for e in own_events]
        assert [e["index"] for e in events] == list(range(10))
        assert events[-1]["generated_text"] == own_events[-1]["generated_text"]
        assert events[-1]["details"]["finish_reason"] == "length"


def test_a_stream_closed_early_is_aborted_on_the_worker(worker):
    """Guards `self._channel.abort(self._key)` in `ChannelStream.aclose`: without it the worker
    would run the 250-token request to its end while its client is gone."""

    async def run():
        c = WorkerClient(worker["sock"])
        try:
            async with c.stream("/generate_stream",
                                WorkerRequest.model_validate(_body("Hello", 250, do_sample=True, seed=1))) as response:
                async for _chunk in response.iter_chunks():
                    break
            await asyncio.sleep(0.3)  # the abort call goes out on the next loop iteration
            return c._channel.dead
        finally:
            await c.aclose()

    before = _generated(worker["sock"])
    assert asyncio.run(run()) is False  # the channel itself stayed open
    health = _idle(worker["sock"])
    assert health["load"] == {"running": 0, "queued": 0}
    assert health["capacity"]["kv_blocks_free"] == 4 * 256 // 8  # every block free again
    assert _generated(worker["sock"]) - before < 200  # the closed stream did not run to its end


def test_a_broken_channel_fails_its_streams_and_the_worker_aborts_them(worker):
    """Guards `self.abort(list(self.streams))` in the worker's `StreamChannel.close`. Closing the
    channel's connection (what the supervisor does to a hung worker) fails every stream on it with
    `WorkerConnectionLost`, and the worker aborts their requests."""

    async def run():
        c = WorkerClient(worker["sock"])
        try:
            async with c.stream("/generate_stream",
                                WorkerRequest.model_validate(_body("Hello", 250, do_sample=True, seed=2))) as response:
                chunks = response.iter_chunks()
                await chunks.__anext__()
                c.abort()
                with pytest.raises(WorkerConnectionLost):
                    async for _chunk in chunks:
                        pass
        finally:
            await c.aclose()

    before = _generated(worker["sock"])
    asyncio.run(run())
    assert _idle(worker["sock"])["load"] == {"running": 0, "queued": 0}
    assert _generated(worker["sock"]) - before < 200  # aborted, not run to its end


def test_bad_channel_headers_are_clear_errors(worker):
    with client(worker["sock"]) as c:
        r = c.post("/generate_stream", json=_body("Hello"), headers={HEADER_CHANNEL: "nope", HEADER_STREAM_KEY: "1"})
        assert r.status_code == 503 and "`nope`" in r.json()["error"] and "GET /streams" in r.json()["error"]
        with c.stream("GET", "/streams") as opened:
            channel_id = opened.headers[HEADER_CHANNEL.lower()]
            r = c.post("/generate_stream", json=_body("Hello"), headers={HEADER_CHANNEL: channel_id,
                                                                          HEADER_STREAM_KEY: "x1"})
            assert r.status_code == 422 and "`x1`" in r.json()["error"]
            r = c.post("/generate_stream", json=_body("Hello"), headers={HEADER_CHANNEL: channel_id,
                                                                          HEADER_STREAM_KEY: b"\xb2"})
            assert r.status_code == 422  # "²" (latin-1): a digit to `str.isdigit`, not to `int`
            r = c.post("/streams/abort", json={"channel": channel_id, "streams": [7]})
            assert r.status_code == 200 and r.json() == {"aborted": 0}
        r = c.post("/streams/abort", json={"channel": channel_id, "streams": ["a"]})
        assert r.status_code == 422


def _fed(data: bytes, step: int = 4) -> asyncio.StreamReader:
    """A reader that holds `data` cut every `step` bytes, then its end."""
    reader = asyncio.StreamReader()
    for i in range(0, len(data), step):
        reader.feed_data(data[i:i + step])
    reader.feed_eof()
    return reader


def test_records_split_anywhere_reach_their_streams():
    """The router's reader takes frames whole however the bytes are cut, and a channel that
    ends fails the streams still open on it."""

    async def run():
        wire = frame(Step([(1, b"hello", False), (2, b"bye", True)])) + frame(Step([(1, b" world", True)]))
        channel = WorkerChannel(_fed(wire), None, "c1")
        (k1, q1), (k2, q2) = channel.register(), channel.register()
        await channel._read()
        first = [q1.get_nowait() for _ in range(q1.qsize())]
        second = [q2.get_nowait() for _ in range(q2.qsize())]
        return (k1, first), (k2, second), channel.dead

    (k1, first), (k2, second), dead = asyncio.run(run())
    assert (k1, k2) == (1, 2)
    assert first == [b"hello", b" world", None] and second == [b"bye", None] and dead


def test_a_channel_cut_mid_frame_fails_the_open_streams():
    async def run():
        channel = WorkerChannel(_fed(frame(Step([(1, b"hello", False)]))[:-3]), None, "c1")
        _, queue = channel.register()
        await channel._read()
        return [queue.get_nowait() for _ in range(queue.qsize())]

    items = asyncio.run(run())
    assert len(items) == 1 and isinstance(items[0], WorkerConnectionLost)


class _Writer:
    def __init__(self):
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        pass


def test_a_refused_submission_answers_as_the_workers_http_route():
    """A `Rejected` record becomes the status, `Retry-After` and `{"error", "error_type"}` body that
    `POST /generate_stream` answers, so the router's client-facing response is the one it was; the
    request crossed as a typed `Submit` carrying the fields its sender set."""

    async def run():
        reader, writer = asyncio.StreamReader(), _Writer()
        channel = WorkerChannel(reader, writer, "c1", {"x-worker-id": "gpu7"})
        reading = asyncio.ensure_future(channel._read())
        body = WorkerRequest.model_validate({"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
        submitting = asyncio.ensure_future(channel.submit(body, {"traceparent": "00-x"}))
        await asyncio.sleep(0)
        reader.feed_data(frame(Rejected(1, 429, "The queue is full", "overloaded", "2")))
        stream = await submitting
        reader.feed_eof()
        await reading
        return stream, writer.sent

    stream, sent = asyncio.run(run())
    assert (stream.status_code, stream.headers["retry-after"], stream.headers["x-worker-id"]) == (429, "2", "gpu7")
    assert json.loads(asyncio.run(stream.read())) == {"error": "The queue is full", "error_type": "overloaded"}
    submit = to_worker(sent[4:])
    assert isinstance(submit, Submit) and submit.key == 1 and submit.trace == {"traceparent": "00-x"}
    assert submit.request == {"inputs": "Hi", "parameters": {"max_new_tokens": 3}}


class _Raw:
    """The engine channel over a blocking socket, as a tool would speak it."""

    def __init__(self, sock):
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(channel_socket_path(sock))

    def send(self, message) -> None:
        self.sock.sendall(frame(message))

    def receive(self):
        def exactly(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = self.sock.recv(n - len(data))
                if not chunk:
                    return b""
                data += chunk
            return data

        head = exactly(4)
        return to_router(exactly(frame_length(head))) if head else None

    def answer(self, key: int):
        """The admission answer for `key` (step frames of other keys skipped)."""
        while True:
            message = self.receive()
            if not isinstance(message, Step) and getattr(message, "key", key) == key:
                return message


def test_the_engine_channel_refuses_as_the_http_route_and_aborts_before_admission(worker):
    """A bad request is a typed `Rejected` with the HTTP route's status and message; a key in use
    is refused; a stream aborted in the same breath as its submission never runs (guards
    `self._admitting.add(message.key)` in `_Connection._read`: without it the abort finds no
    such stream and the 250-token request runs to its end). A first message other than `open`
    closes the connection."""
    stray = _Raw(worker["sock"])
    stray.send(Abort([1]))
    assert stray.receive() is None  # closed, nothing answered
    raw = _Raw(worker["sock"])
    raw.send(Open(ids=True))
    opened = raw.receive()
    assert isinstance(opened, Opened) and opened.headers["X-Worker-Id"] == "gpu7"
    raw.send(Submit(1, {"inputs": "Hello", "parameters": {"max_new_tokens": -1}}))
    refused = raw.answer(1)
    with client(worker["sock"]) as c:
        http = c.post("/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": -1}})
    assert isinstance(refused, Rejected) and (refused.status, refused.error_type) == (422, "validation")
    assert refused.error == http.json()["error"] and "`max_new_tokens`" in refused.error
    raw.send(Submit(2, {"inputs": "Hello", "parameters": {"max_new_tokens": 0, "decoder_input_details": True}}))
    assert raw.answer(2).status == 422  # prompt scoring is `/generate`'s, not a stream's
    before = _generated(worker["sock"])
    raw.send(Submit(3, {"inputs": "Hello", "parameters": {"max_new_tokens": 250, "do_sample": True, "seed": 3}}))
    raw.send(Abort([3]))
    raw.send(Submit(4, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}))
    raw.send(Submit(4, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}))
    answers = [raw.answer(4), raw.answer(4)]  # one admitted, the other refused (in whichever order they end)
    refused = [a for a in answers if isinstance(a, Rejected)]
    assert len(refused) == 1 and "`4` is in use" in refused[0].error
    assert sum(isinstance(a, Admitted) for a in answers) == 1
    health = _idle(worker["sock"])
    assert health["load"] == {"running": 0, "queued": 0}
    assert _generated(worker["sock"]) - before < 200  # stream 3 never ran to its end
    raw.sock.close()


def test_a_worker_with_an_idle_channel_stops_at_once(worker):
    """Guards the `ctx.stopping()` check in `StreamChannel.frames`: without it uvicorn waits its
    whole graceful-shutdown time (30 s) for the channel's response to end."""

    async def open_channel():
        c = WorkerClient(worker["sock"])
        assert await c._open_channel() is not None
        return c

    loop = asyncio.new_event_loop()
    try:
        c = loop.run_until_complete(open_channel())
        started = time.monotonic()
        worker["proc"].send_signal(signal.SIGTERM)
        assert worker["proc"].wait(timeout=20) == 0
        assert time.monotonic() - started < 15  # far under the 30 s it waits without the check
        loop.run_until_complete(c.aclose())
    finally:
        loop.close()
    with pytest.raises(httpx.TransportError):
        client(worker["sock"]).get("/health")


def _frames(sent: bytes, decode=to_worker) -> list:
    out = []
    while sent:
        n = frame_length(sent[:4])
        out.append(decode(sent[4:4 + n]))
        sent = sent[4 + n:]
    return out


def test_only_a_stream_the_worker_has_not_ended_is_aborted():
    """Guards `carried` in `WorkerChannel.abort`: every `/generate` sent the worker an `Abort` for
    the stream it had just ended (its last record read, its end marker not yet)."""

    async def run():
        reader, writer = asyncio.StreamReader(), _Writer()
        channel = WorkerChannel(reader, writer, "c1")
        reading = asyncio.ensure_future(channel._read())
        body = WorkerRequest.model_validate({"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
        submits = [asyncio.ensure_future(channel.submit(body, None)) for _ in range(2)]
        await asyncio.sleep(0)
        reader.feed_data(frame(Admitted(1)) + frame(Admitted(2)) + frame(Step([(1, b"x", True), (2, b"y", False)])))
        ended, open_ = [await s for s in submits]
        async for _ in ended.iter_chunks():
            break  # its last record, as a relay stops after the finish event
        await ended.aclose()
        await open_.aclose()
        await asyncio.sleep(0)  # the iteration's aborts leave at its end
        reader.feed_eof()
        await reading
        return _frames(writer.sent)

    sent = asyncio.run(run())
    assert [type(m) for m in sent] == [Submit, Submit, Abort] and sent[2].keys == [2]


def test_an_admission_answer_leaves_with_the_next_step_frame():
    """Guards `_Connection._defer_admitted`: `Admitted` went out in its own write, a wake-up of the
    router of its own, just before the step frame that carries the stream's first event."""
    from workers.serving.engine_channel import ADMIT_DEFER_S, _Connection

    async def run():
        writer = _Writer()
        writer.is_closing = lambda: False
        connection = _Connection(None, None, writer, {})
        connection._defer_admitted(1)
        connection._defer_admitted(2)
        before = writer.sent
        taken = connection._take_admitted()  # what the next step frame carries in front of it
        connection._defer_admitted(3)
        await asyncio.sleep(ADMIT_DEFER_S * 2)  # no step frame came: it leaves on its own
        return before, _frames(taken, to_router), _frames(writer.sent, to_router)

    before, taken, alone = asyncio.run(run())
    assert before == b"" and taken == [Admitted(1), Admitted(2)] and alone == [Admitted(3)]
