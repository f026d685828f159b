"""The router's end of a worker's engine channel: every generation over one connection.

The router submits each request to the worker as a typed `Submit` frame and receives every
stream's events of an engine step as one `Step` frame, all on one raw Unix socket beside the
worker's HTTP socket (workers/contract/channel.py, workers/serving/engine_channel.py), so a
request costs the worker no HTTP exchange and a step costs it one write instead of one per
stream. The channel's socket protocol splits the frames in the callback that brings their bytes
(no reader task to wake per frame): admissions (`Admitted`, or `Rejected` with the status and
body the worker's HTTP route would have answered) resolve the submitter's wait, records go to
per-stream queues (`_read` does the same from a `StreamReader`). `ChannelStream` reads one queue
with the same interface as a streamed response of the pool, so the dispatcher, the SSE splitting
and stream migration above it do not know the difference. A channel that breaks fails every
stream on it with `WorkerConnectionLost`, as a broken `/generate_stream` connection fails its one
stream. A worker without the channel's socket (`ChannelRefused`) is served over HTTP, one request
per connection.
Trade-off: the records of a client that reads slowly wait in its queue here rather than in a
socket buffer (at most its generation's events), since one stream must never hold up the channel
for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging

from server.fleet.text import StreamText, TextModel, text_model
from server.fleet.uds_http import UnixHTTPPool, WorkerConnectionLost
from workers.contract import HEADER_VOCAB, WorkerRequest
from workers.contract.channel import (
    Abort,
    Admitted,
    Open,
    Opened,
    OpenRefused,
    Rejected,
    Step,
    Submit,
    channel_socket_path,
    frame,
    frame_length,
    to_router,
)
from workers.contract.events import decode_batch

logger = logging.getLogger(__name__)

STREAM_PATH = "/generate_stream"  # the worker route whose requests go on the channel
GENERATE_PATH = "/generate"  # answered from a stream on the channel when the router builds the text
_TOKENIZER_TIMEOUT_S = 30.0  # a large vocabulary's JSON, read once per channel
_OPEN_TIMEOUT_S = 5.0


class ChannelRefused(Exception):
    """The worker did not open a channel (its status says why: 404 when it has no channel socket);
    its generations go over HTTP, one per connection."""

    def __init__(self, status: int, why: str = ""):
        super().__init__(f"the engine channel was refused ({status}){': ' + why if why else ''}")
        self.status = status


class WorkerChannel:
    """One open channel to a worker; `dead` once it broke (the worker died, or `close_now()` cut
    it) or was closed. A stream closed before its last record sends the worker an `Abort` (the
    aborts of one loop iteration in one frame)."""

    def __init__(self, reader: asyncio.StreamReader | None, writer: asyncio.StreamWriter | None, channel_id: str,
                 headers: dict[str, str] | None = None, text: TextModel | None = None):
        self._reader_stream, self._writer = reader, writer
        self.id = channel_id
        self.headers = headers or {}  # the worker's identity headers, as its HTTP answers carry them
        self.text = text  # its records are token ids, rendered here with this tokenizer (None: SSE text)
        self.dead = False
        self._queues: dict[int, asyncio.Queue] = {}
        self._admissions: dict[int, asyncio.Future] = {}
        self._keys = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._aborts: list[int] = []

    @classmethod
    async def open(cls, pool: UnixHTTPPool, ids: bool = True) -> WorkerChannel:
        """A channel whose reader runs, carrying token ids when `ids` and the worker gives its
        tokenizer (else SSE text); `ChannelRefused` when the worker has no channel socket or does
        not open it, one of `WorkerGone` when it cannot be reached."""
        text = await _worker_text(pool) if ids else None
        try:
            transport, frames = await asyncio.get_running_loop().create_unix_connection(
                _FrameProtocol, channel_socket_path(pool.path))
        except FileNotFoundError:
            raise ChannelRefused(404, "no channel socket") from None
        except OSError as e:  # a stale socket file: nothing listens
            raise ChannelRefused(503, e.strerror or repr(e)) from None
        try:
            transport.write(frame(Open(ids=text is not None)))
            answer = to_router(await asyncio.wait_for(frames.first(), _OPEN_TIMEOUT_S))
            if not isinstance(answer, Opened):
                raise ChannelRefused(answer.status if isinstance(answer, OpenRefused) else 502,
                                     getattr(answer, "error", type(answer).__name__))
        except (OSError, TimeoutError, ValueError) as e:
            transport.close()
            raise ChannelRefused(503, repr(e)) from None
        except BaseException:
            transport.close()
            raise
        headers = {name.lower(): value for name, value in answer.headers.items()}  # as the pool's answers
        channel = cls(None, transport, answer.channel, headers, text if answer.ids else None)
        frames.attach(channel)
        return channel

    def register(self) -> tuple[int, asyncio.Queue]:
        """A fresh stream key and the queue its records will arrive in."""
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        return key, queue

    async def submit(self, body: WorkerRequest, trace: dict[str, str] | None, generate: bool = False,
                     text: StreamText | None = None) -> ChannelStream:
        """Send `body` and wait for the worker's admission: the stream (its text built with
        `text`), or the refusal as a `ChannelStream` with its status, headers and body.
        `WorkerConnectionLost` when the channel breaks first."""
        if self.dead:
            raise WorkerConnectionLost("the engine channel is closed")
        key, queue = self.register()
        admitted = asyncio.get_running_loop().create_future()
        self._admissions[key] = admitted
        self._writer.write(frame(Submit(key, body.model_dump(exclude_unset=True), trace or {}, generate)))
        try:
            answer = await admitted
        except BaseException:  # lost or cancelled: the worker may admit it still
            self.abort(key)
            raise
        if isinstance(answer, Admitted):
            return ChannelStream(200, self.headers, channel=self, key=key, queue=queue, text=text)
        self._queues.pop(key, None)
        headers = {**self.headers, "content-type": "application/json"}
        if answer.retry_after is not None:
            headers["retry-after"] = answer.retry_after
        content = json.dumps({"error": answer.error, "error_type": answer.error_type}, ensure_ascii=False,
                             separators=(",", ":")).encode()
        return ChannelStream(answer.status, headers, content)

    def abort(self, key: int) -> None:
        """Stop carrying stream `key`; the worker ends it (one frame for this iteration's aborts).
        Nothing to send for a stream whose last record came (the worker has ended it)."""
        carried = self._queues.pop(key, None) is not None
        carried = self._admissions.pop(key, None) is not None or carried
        if self.dead or not carried:
            return
        self._aborts.append(key)
        if len(self._aborts) == 1:
            asyncio.get_running_loop().call_soon(self._send_aborts)

    def _send_aborts(self) -> None:
        keys, self._aborts = self._aborts, []
        if keys and not self.dead:
            self._writer.write(frame(Abort(keys)))

    def _frame(self, body: bytes) -> None:
        """One frame from the worker: a step's records into their streams' queues, an admission
        to its submitter; `ValueError` for one that is no message of an open channel."""
        message = to_router(body)
        if type(message) is Step:
            queues = self._queues
            for key, data, end in message.records:
                queue = queues.get(key)
                if queue is not None:
                    queue.put_nowait(data)
                    if end:
                        queue.put_nowait(None)
                        del queues[key]
        elif isinstance(message, Admitted | Rejected):
            waiter = self._admissions.pop(message.key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        else:
            raise ValueError(f"`{type(message).__name__}` after the channel opened")

    def _end(self, error: BaseException) -> None:
        """The channel is over: every stream and admission left fails with `error`."""
        self.dead = True
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        for waiter in self._admissions.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._admissions.clear()
        if self._writer is not None:
            self._writer.close()

    async def _read(self) -> None:
        """Frames from a `StreamReader` into admissions and the streams' queues until the channel
        ends; then every stream left fails."""
        error: BaseException = WorkerConnectionLost(_CLOSED)
        reader = self._reader_stream
        try:
            while True:
                head = await reader.readexactly(4)
                self._frame(await reader.readexactly(frame_length(head)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ValueError as e:  # a malformed frame: nothing after it can be trusted
            error = _malformed(e)
        finally:
            self._end(error)

    def close_now(self) -> None:
        """Cut the connection (the worker hangs): every stream on it fails at once."""
        self.dead = True
        if self._writer is not None:
            getattr(self._writer, "transport", self._writer).abort()

    async def aclose(self) -> None:
        self.dead = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._reader_stream is None:
            self._end(WorkerConnectionLost(_CLOSED))  # as the reader's end would
        if self._writer is not None:
            self._writer.close()


_CLOSED = "the worker closed its engine channel"


def _malformed(e: ValueError) -> WorkerConnectionLost:
    return WorkerConnectionLost(f"malformed engine channel frame: {e!r}")


class _FrameProtocol(asyncio.Protocol):
    """The channel's socket: whole frames out of the bytes as they come, the first one (the
    answer to `Open`) to `first()`, every later one to the attached channel in the same callback."""

    def __init__(self):
        self._buffer = bytearray()
        self._channel: WorkerChannel | None = None
        self._early: list[bytes] = []  # frames before a channel is attached
        self._first: asyncio.Future = asyncio.get_running_loop().create_future()
        self._over = False

    def first(self) -> asyncio.Future:
        """The first frame's body; `ConnectionError` when the socket ends before it, `ValueError`
        for a malformed length."""
        return self._first

    def attach(self, channel: WorkerChannel) -> None:
        self._channel = channel
        early, self._early = self._early, []
        for body in early:
            self._deliver(body)
        if self._over:  # it ended while the channel was being made
            channel._end(WorkerConnectionLost(_CLOSED))

    def data_received(self, data: bytes) -> None:
        if self._over:
            return
        buffer = self._buffer
        buffer += data
        try:
            while len(buffer) >= 4:
                end = 4 + frame_length(bytes(buffer[:4]))
                if len(buffer) < end:
                    return
                body = bytes(buffer[4:end])
                del buffer[:end]
                self._deliver(body)
                if self._over:
                    return
        except ValueError as e:
            self._fail(e)

    def _deliver(self, body: bytes) -> None:
        if not self._first.done():
            self._first.set_result(body)
        elif self._channel is None:
            self._early.append(body)
        else:
            try:
                self._channel._frame(body)
            except ValueError as e:  # a malformed frame: nothing after it can be trusted
                self._fail(e)

    def _fail(self, e: ValueError) -> None:
        self._over = True
        if not self._first.done():
            self._first.set_exception(e)
        elif self._channel is not None:
            self._channel._end(_malformed(e))

    def connection_lost(self, exc) -> None:
        if self._over:
            return
        self._over = True
        if not self._first.done():
            self._first.set_exception(ConnectionError("the engine channel closed before it opened"))
        elif self._channel is not None:
            self._channel._end(WorkerConnectionLost(_CLOSED))


async def _worker_text(pool: UnixHTTPPool) -> TextModel | None:
    """The worker's tokenizer (`GET /tokenizer`), None when it gives none (it renders its streams)."""
    status, headers, content = await asyncio.wait_for(pool.request("GET", "/tokenizer"), _TOKENIZER_TIMEOUT_S)
    vocab = headers.get(HEADER_VOCAB.lower(), "")
    if status != 200 or not vocab.isdigit():
        return None
    return await text_model(content, int(vocab))


class ChannelStream:
    """One stream on a channel, read like the pool's streamed `Response`; a refusal (status other
    than 200) carries its body instead. On a channel of token ids, `text` renders its records
    into the SSE events the worker would have sent, and a stop string it finds ends the stream."""

    def __init__(self, status: int, headers: dict[str, str], content: bytes = b"",
                 channel: WorkerChannel | None = None, key: int = 0, queue: asyncio.Queue | None = None,
                 text: StreamText | None = None):
        self.status_code, self.headers = status, headers
        self._content, self._channel, self._key, self._queue = content, channel, key, queue
        self._text = text
        self._done = queue is None

    @property
    def text(self) -> StreamText | None:
        return self._text

    async def _records(self):
        """The worker's records for this stream, until its last."""
        queue = self._queue
        while True:
            item = await queue.get()
            if item is None:
                self._done = True
                return
            if isinstance(item, BaseException):
                self._done = True  # nothing to abort: the channel is gone
                raise item
            yield item

    async def iter_chunks(self):
        if self._queue is None:
            if self._content:
                yield self._content
            return
        text = self._text
        async for item in self._records():
            if text is None:
                yield item
                continue
            try:
                rendered, ended = text.feed(*decode_batch(item))
            except ValueError as e:  # a malformed record: as a broken channel, for this stream
                raise WorkerConnectionLost(f"malformed stream record: {e!r}") from None
            if rendered:
                yield rendered.encode()
            if ended:  # its finish or error; a stop string found here leaves the worker's to abort
                return

    async def event_batches(self):
        """On a channel of token ids: each record's events with their text, up to the last."""
        text = self._text
        async for item in self._records():
            try:
                events, ended = text.events(*decode_batch(item))
            except ValueError as e:
                raise WorkerConnectionLost(f"malformed stream record: {e!r}") from None
            yield events
            if ended:
                return

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks()])

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._channel.abort(self._key)
