"""The router's end of a worker's stream channel: many streams over one connection.

The worker writes every stream's events of an engine step as one frame on one long response
(`GET /streams`, workers/serving/channel.py), so a step costs it one write instead of one per
stream. One reader task per channel splits the frames into per-stream queues; `ChannelStream`
reads one queue with the same interface as a streamed response of the pool, so the dispatcher,
the SSE splitting and stream migration above it do not know the difference. A channel that
breaks fails every stream on it with `WorkerConnectionLost`, as a broken `/generate_stream`
connection fails its one stream. Trade-off: the records of a client that reads slowly wait in
its queue here rather than in a socket buffer (at most its generation's events), since one
stream must never hold up the channel for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

from server.fleet.text import StreamText, TextModel, text_model
from server.fleet.uds_http import UnixHTTPPool, WorkerConnectionLost
from workers.contract import HEADER_CHANNEL, HEADER_TEXT, HEADER_VOCAB, TEXT_IDS, AbortStreams, wire_bytes
from workers.contract.events import decode_batch

logger = logging.getLogger(__name__)

STREAM_PATH = "/generate_stream"  # the worker route that streams on the channel
GENERATE_PATH = "/generate"  # answered from a stream on the channel when the router builds the text
_TOKENIZER_TIMEOUT_S = 30.0  # a large vocabulary's JSON, read once per channel


class ChannelRefused(Exception):
    """The worker did not open a channel (its status says why); streams go one per connection."""

    def __init__(self, status: int):
        super().__init__(f"GET /streams answered {status}")
        self.status = status


class WorkerChannel:
    """One open channel to a worker; `dead` once it broke (the worker died, or `abort()` closed its
    connections) or was closed.

    A frame holds, per stream, a record `b"<key> <length> <end>\\n"` and `length` bytes of the
    SSE events its `/generate_stream` would have sent. A stream closed before its last record
    sends the worker `POST /streams/abort` (the aborts of one loop iteration in one call), as
    closing its connection did."""

    def __init__(self, pool: UnixHTTPPool, channel_id: str, text: TextModel | None = None):
        self._pool = pool
        self.id = channel_id
        self.text = text  # its records are token ids, rendered here with this tokenizer (None: SSE text)
        self.dead = False
        self._queues: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self._aborts: list[int] = []
        self._tasks: set[asyncio.Task] = set()  # abort calls under way

    @classmethod
    async def open(cls, pool: UnixHTTPPool, ids: bool = True) -> WorkerChannel:
        """A channel whose reader runs, carrying token ids when `ids` and the worker gives its
        tokenizer (else SSE text); `ChannelRefused` when the worker answers other than 200, one of
        `WorkerGone` when it cannot be reached."""
        text = await _worker_text(pool) if ids else None
        response = await pool.send("GET", "/streams", headers={HEADER_TEXT: TEXT_IDS} if text else None)
        channel_id = response.headers.get(HEADER_CHANNEL.lower())
        if response.status_code != 200 or not channel_id:
            await response.read()
            raise ChannelRefused(response.status_code)
        if response.headers.get(HEADER_TEXT.lower()) != TEXT_IDS:
            text = None  # the worker renders its streams itself
        channel = cls(pool, channel_id, text)
        channel._reader = asyncio.ensure_future(channel._read(response))
        return channel

    def register(self) -> tuple[int, asyncio.Queue]:
        """A fresh stream key and the queue its records will arrive in."""
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        return key, queue

    def forget(self, key: int) -> None:
        """Stop carrying stream `key`, which the worker refused (nothing to end there)."""
        self._queues.pop(key, None)

    def abort(self, key: int) -> None:
        """Stop carrying stream `key`; the worker ends it (one call for this iteration's aborts)."""
        self._queues.pop(key, None)
        if self.dead:
            return
        self._aborts.append(key)
        if len(self._aborts) == 1:
            asyncio.get_running_loop().call_soon(self._send_aborts)

    def _send_aborts(self) -> None:
        keys, self._aborts = self._aborts, []
        if keys and not self.dead:
            task = asyncio.ensure_future(self._post_abort(keys))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post_abort(self, keys: list[int]) -> None:
        body = wire_bytes(AbortStreams(channel=self.id, streams=tuple(keys)))
        try:
            await asyncio.wait_for(self._pool.request("POST", "/streams/abort", body), 5.0)
        except (OSError, TimeoutError) as e:  # the worker is gone (its streams with it) or hangs
            logger.debug("aborting streams %s on channel %s failed: %r", keys, self.id, e)

    async def _read(self, response) -> None:
        """Frames into the streams' queues until the channel ends; then every stream left fails."""
        error: BaseException = WorkerConnectionLost("the worker closed its stream channel")
        buffer = b""
        queues = self._queues
        try:
            async for chunk in response.iter_chunks():
                buffer = buffer + chunk if buffer else chunk
                at, size = 0, len(buffer)
                while at < size:
                    nl = buffer.find(b"\n", at)
                    if nl < 0:
                        break
                    key, length, end = buffer[at:nl].split(b" ")
                    start = nl + 1
                    stop = start + int(length)
                    if stop > size:
                        break
                    queue = queues.get(int(key))
                    if queue is not None:
                        queue.put_nowait(buffer[start:stop])
                        if end == b"1":
                            queue.put_nowait(None)
                            del queues[int(key)]
                    at = stop
                buffer = buffer[at:]
        except WorkerConnectionLost as e:
            error = e
        except ValueError as e:  # a malformed record: nothing after it can be trusted
            error = WorkerConnectionLost(f"malformed stream channel record: {e!r}")
        finally:
            self.dead = True
            for queue in queues.values():
                queue.put_nowait(error)
            queues.clear()
            with contextlib.suppress(Exception):
                await response.aclose()

    async def aclose(self) -> None:
        self.dead = True
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


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
