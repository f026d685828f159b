"""A client's stream carried across workers: nothing lost, nothing repeated.

`ClientStream` relays one worker stream's events to the client; when that worker is lost before
the last event, the same request goes to another worker that meets its constraints with the
token ids the client already has (`resume_ids`), and that worker goes on from the next token as
the first would have (workers/engine/resume.py); what the client sees: docs/serving.md. Design:
the relay forwards the workers' bytes untouched and parses nothing on the way (a prefix test for
an error event, a substring test for the final one); the raw events relayed are parsed for their
token ids only when a move happens, or folded into token ids once they pass `SEGMENT_BYTES`, so
a stream holds at most that many raw bytes plus 8 bytes per token it relayed. Trade-off: a
stream keeps up to `SEGMENT_BYTES` of relayed events so that the common case, a short stream
that never moves, costs no JSON work in the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from array import array
from collections.abc import AsyncIterator

import anyio

from server.dispatch.buffers import STREAM_BUFFER_BYTES, ByteQueue
from server.dispatch.dispatcher import Dispatcher, DispatchError, WorkerReply, WorkerStream
from server.dispatch.faults import Deaths, fingerprint
from server.dispatch.spans import note_migration
from server.fleet.client import WorkerGone, split_events
from server.routing.filter import Constraints
from workers.contract import RESUME_IDS, WorkerRequest
from workers.contract.errors import ERROR_INTERNAL, is_request_fault

logger = logging.getLogger(__name__)

_ERROR_PREFIX = '{"error"'  # how a worker's error event starts (its JSON has `error` first)
_NOT_FINAL = '"generated_text": null'  # in every worker event but the last (quotes in text are escaped)
SEGMENT_BYTES = 64 * 1024  # raw relayed bytes a stream keeps before folding them into token ids


class StreamIncomplete(Exception):
    """The stream lost its worker and no worker can continue it; the message says why."""

    error_type = "incomplete_generation"


class StreamRefused(StreamIncomplete):
    """The worker ended the stream with an error that blames the request (not moved)."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.error_type = error_type


def parse_event(data: str) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def is_final(event: dict | None) -> bool:
    """A worker stream's last event carries `details`/`generated_text`, or is an error."""
    if event is None:
        return False
    return (event.get("error") is not None or event.get("details") is not None
            or event.get("generated_text") is not None)


def _last_event_start(raw: bytes) -> int:
    """Where the last complete event of `raw` (events ending in a blank line) begins."""
    previous = raw.rfind(b"\n\n", 0, len(raw) - 2)
    return 0 if previous < 0 else previous + 2


def token_ids(raws: list[bytes]) -> list[int]:
    """The token ids of relayed token events (raw SSE bytes)."""
    ids = []
    for raw in raws:
        for data in split_events(raw):
            event = parse_event(data) or {}
            token = event.get("token") or {}
            if isinstance(token.get("id"), int):
                ids.append(token["id"])
    return ids


async def open_client_stream(dispatcher: Dispatcher, path: str, body: WorkerRequest,
                             c: Constraints) -> ClientStream | WorkerReply:
    """A client stream whose first event exists, or the worker's refusal (e.g. 422) as a reply; a
    long prompt's is prefilled on a prefill worker where roles are set (server/dispatch/handoff.py)."""
    if dispatcher.disagg is not None and (handed := await dispatcher.disagg.open(dispatcher, path, body, c)):
        return handed
    opened = await dispatcher.open_stream(path, body, c)
    if isinstance(opened, WorkerReply):
        return opened
    return ClientStream(dispatcher, path, body, c, opened)


class ClientStream:
    """One client stream over one or more worker streams; `aclose()` always, once.

    A worker is lost when it dies, its connection breaks, the supervisor finds it hung and breaks
    the connection, or it ends the stream with an error event. At most `--migration-limit` moves
    per stream; when no worker can continue (the limit, none left, a refusal) the client gets one
    error event saying why. The last event of a moved stream says how often it moved
    (`details.migrations`); `/metrics` counts moves per worker that lost a stream, and the
    request's span gets a `migrate` event per move. An error event that blames the request
    (`validation`: its grammar cannot be completed) is its end, not a loss: `StreamRefused`,
    never moved. A lost connection or an `internal` error event is a death the stream witnessed:
    at the second it is not moved again and the request is quarantined
    (server/dispatch/faults.py). The worker's final event ends the dispatch's ticket at once (its
    admission slot is free when the worker is done, whether or not the client reads the rest)."""

    def __init__(self, dispatcher: Dispatcher, path: str, body: WorkerRequest, c: Constraints,
                 first: WorkerStream):
        self.dispatcher, self.path, self.body, self.constraints = dispatcher, path, body, c
        self.stream = first  # the worker stream serving now
        self.headers = first.headers  # the response's headers: the first worker's
        self.migrations = 0
        self._delivered = array("q")  # token ids relayed (those of `_segment` not yet)
        self._segment: list[bytes] = []  # raw events relayed from the current worker, not yet folded
        self._segment_bytes = 0
        self._exclude: dict[str, int] = {}  # workers (id -> generation) that lost this stream
        self._deaths = Deaths()  # workers that died under it
        self._buffer = ByteQueue(STREAM_BUFFER_BYTES)  # read ahead of the client, bounded (server/dispatch/buffers.py)
        self._reader: asyncio.Task | None = None

    @property
    def worker(self):
        return self.stream.worker

    @property
    def tokens_sent(self) -> int:
        return len(self._delivered) + len(token_ids(self._segment))

    def _keep(self, raw: bytes) -> None:
        """Remember relayed events for a move, folding them into token ids past `SEGMENT_BYTES`."""
        self._segment.append(raw)
        self._segment_bytes += len(raw)
        if self._segment_bytes > SEGMENT_BYTES:
            self._delivered.extend(token_ids(self._segment))
            self._segment, self._segment_bytes = [], 0

    async def aclose(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self.stream.aclose()

    async def events(self) -> AsyncIterator[str]:
        """Every event's data payload, across workers; raises `StreamIncomplete`."""
        async for raw in self.batches():
            for data in split_events(raw):
                yield data

    async def batches(self) -> AsyncIterator[bytes]:
        """Raw bytes of complete events, in order, across workers, read ahead of the caller into a
        buffer of `STREAM_BUFFER_BYTES` (the worker's last event, and with it its admission slot,
        comes in even while the client reads slowly); raises `StreamIncomplete`."""
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_ahead())
        while True:
            items = await self._buffer.get_all()
            raws = []
            for item in items:
                if isinstance(item, BaseException):
                    if raws:
                        yield b"".join(raws)
                    raise item
                if item is None:
                    if raws:
                        yield b"".join(raws)
                    return
                raws.append(item)
            yield b"".join(raws)

    async def _read_ahead(self) -> None:
        """The worker streams' batches into the buffer, then None (the end) or the exception."""
        try:
            async for raw in self._relayed():
                await self._buffer.put(raw, len(raw))
            await self._buffer.put(None, 0)
        except Exception as e:  # StreamIncomplete, or anything else: the reader hands it over
            await self._buffer.put(e, 0)

    async def _relayed(self) -> AsyncIterator[bytes]:
        """Raw bytes of complete events, in order, across workers; raises `StreamIncomplete`."""
        batch: tuple[bytes, str] | None = (self.stream.first_raw, self.stream.first_data)
        while True:
            died = False
            try:
                while batch is not None:
                    raw, last = batch
                    if last.startswith(_ERROR_PREFIX):  # the worker gave up on it: relay what came before
                        start = _last_event_start(raw)
                        if start:
                            self._keep(raw[:start])
                            yield raw[:start]
                        error = parse_event(last) or {}
                        message, kind = str(error.get("error", last)), error.get("error_type")
                        if is_request_fault(kind):  # the request's own end: no other worker would do better
                            self.stream.finish()
                            raise StreamRefused(message, kind)
                        why, died = f"worker error: {message}", kind == ERROR_INTERNAL
                        break
                    if _NOT_FINAL not in last and is_final(parse_event(last)):
                        self.stream.finish()  # the worker is done: its admission slot is free now
                        if self.migrations:
                            raw = self._with_migrations(raw, last)
                    self._keep(raw)
                    yield raw
                    batch = await self.stream.sse.next_batch()
                else:
                    if is_final(parse_event(last)):
                        return
                    why = "the stream ended before its last event"
            except WorkerGone as e:
                why, died = f"connection lost: {e!r}", True
            batch = await self._move(why, died)

    def _with_migrations(self, raw: bytes, last: str) -> bytes:
        """The batch with its final event's `details.migrations` set."""
        event = parse_event(last) or {}
        if isinstance(event.get("details"), dict):
            event["details"]["migrations"] = self.migrations
        start = _last_event_start(raw)
        return raw[:start] + f"data: {json.dumps(event)}\n\n".encode()

    async def _move(self, why: str, died: bool) -> tuple[bytes, str]:
        """Continue on another worker: its first batch, or `StreamIncomplete`. `died`: the worker
        died with the stream in flight (a second such death ends it)."""
        lost = self.stream
        self._delivered.extend(token_ids(self._segment))
        self._segment, self._segment_bytes = [], 0
        lost.worker.request_outcome(lost.generation, False, why)
        self._exclude[lost.worker.id] = lost.generation
        self.dispatcher.supervisor.report_unreachable(lost.worker, lost.generation)
        with anyio.CancelScope(shield=True):
            await lost.aclose()
        sent = len(self._delivered)
        lost_msg = f"worker {lost.worker.id} was lost after {sent} tokens ({why}); the generation is incomplete"
        if died and lost.worker.crashed_under(lost.generation) and self._deaths.witnessed(lost.worker.id):
            try:
                self.dispatcher.refuse(lambda: fingerprint(self.path, self.body), self._deaths)
            except DispatchError as e:
                raise StreamIncomplete(f"{lost_msg}: {e.message}") from e
        limit = self.dispatcher.settings.migration_limit
        if self.migrations >= limit:
            moved = f"it already moved {self.migrations} times" if limit else "stream migration is off"
            raise StreamIncomplete(f"{lost_msg}: {moved} (--migration-limit {limit})")
        self.dispatcher.metrics.stream_migration(lost.worker)
        note_migration(self.dispatcher.tracing, lost.worker, why, sent)
        logger.warning("stream on worker %s lost after %d tokens (%s); moving it", lost.worker.id, sent, why)
        body = self.body.model_copy(update={RESUME_IDS: tuple(self._delivered)})
        try:
            opened = await self.dispatcher.open_stream(self.path, body, self.constraints, self._exclude, self._deaths)
        except DispatchError as e:
            raise StreamIncomplete(f"{lost_msg}: no worker could continue it: {e.message}") from e
        if isinstance(opened, WorkerReply):
            detail = (parse_event(opened.content.decode("utf-8", errors="replace")) or {}).get("error")
            raise StreamIncomplete(f"{lost_msg}: worker {opened.worker.id} refused to continue it "
                                   f"({opened.status}: {detail or 'no message'})")
        self.migrations += 1
        self.stream = opened
        return opened.first_raw, opened.first_data
