"""A client's stream carried across workers: nothing lost, nothing repeated.

`ClientStream` relays one worker stream's events to the client. When that worker is lost
before the last event (it dies, its connection breaks, the supervisor finds it hung and
breaks the connection, or it ends the stream with an error event), the stream moves: the
same request goes to another worker that meets its constraints, with the token ids the client
has already received (`resume_ids`); that worker goes on from the next token as the first
would have (workers/engine/resume.py: same indices, counts, text, seeded draws), and its events
follow on the same client stream. At most `--migration-limit` moves per stream; when no
worker can continue (the limit, none left, a refusal) the client gets one error event saying
why, as before. The last event of a moved stream says how often it moved
(`details.migrations`); `/metrics` counts moves per worker that lost a stream, and the
request's span gets a `migrate` event per move.

Design: the relay forwards the workers' bytes untouched and parses nothing on the way (it
only checks whether a batch ends with an error event, a prefix test); the raw events relayed
are kept and parsed for their token ids only when a move happens. Trade-off: a stream keeps
its relayed bytes until it ends (some 150 bytes per token) so that the common case, a stream
that never moves, costs no JSON work in the router.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import anyio

from server.dispatch.dispatcher import Dispatcher, DispatchError, WorkerReply, WorkerStream
from server.dispatch.spans import note_migration
from server.fleet.client import WorkerGone, split_events
from server.routing.filter import Constraints
from workers.contract import RESUME_IDS

logger = logging.getLogger(__name__)

_ERROR_PREFIX = '{"error"'  # how a worker's error event starts (its JSON has `error` first)


class StreamIncomplete(Exception):
    """The stream lost its worker and no worker can continue it; the message says why."""


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
    return event.get("error") is not None or event.get("details") is not None or event.get("generated_text") is not None


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


async def open_client_stream(dispatcher: Dispatcher, path: str, body: dict,
                             c: Constraints) -> ClientStream | WorkerReply:
    """A client stream whose first event exists, or the worker's refusal (e.g. 422) as a reply."""
    opened = await dispatcher.open_stream(path, body, c)
    if isinstance(opened, WorkerReply):
        return opened
    return ClientStream(dispatcher, path, body, c, opened)


class ClientStream:
    """One client stream over one or more worker streams (see the module docstring);
    `aclose()` always, once."""

    def __init__(self, dispatcher: Dispatcher, path: str, body: dict, c: Constraints, first: WorkerStream):
        self.dispatcher, self.path, self.body, self.constraints = dispatcher, path, body, c
        self.stream = first  # the worker stream serving now
        self.headers = first.headers  # the response's headers: the first worker's
        self.migrations = 0
        self._delivered: list[int] = []  # token ids relayed from workers before the current one
        self._segment: list[bytes] = []  # raw events relayed from the current worker
        self._exclude: dict[str, int] = {}  # workers (id -> generation) that lost this stream

    @property
    def worker(self):
        return self.stream.worker

    @property
    def tokens_sent(self) -> int:
        return len(self._delivered) + len(token_ids(self._segment))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def events(self) -> AsyncIterator[str]:
        """Every event's data payload, across workers; raises `StreamIncomplete`."""
        async for raw in self.batches():
            for data in split_events(raw):
                yield data

    async def batches(self) -> AsyncIterator[bytes]:
        """Raw bytes of complete events, in order, across workers; raises `StreamIncomplete`."""
        batch: tuple[bytes, str] | None = (self.stream.first_raw, self.stream.first_data)
        while True:
            try:
                while batch is not None:
                    raw, last = batch
                    if last.startswith(_ERROR_PREFIX):  # the worker gave up on it: relay what came before
                        start = _last_event_start(raw)
                        if start:
                            self._segment.append(raw[:start])
                            yield raw[:start]
                        why = f"worker error: {(parse_event(last) or {}).get('error', last)}"
                        break
                    if self.migrations and is_final(parse_event(last)):
                        raw = self._with_migrations(raw, last)
                    self._segment.append(raw)
                    yield raw
                    batch = await self.stream.sse.next_batch()
                else:
                    if is_final(parse_event(last)):
                        return
                    why = "the stream ended before its last event"
            except WorkerGone as e:
                why = f"connection lost: {e!r}"
            batch = await self._move(why)

    def _with_migrations(self, raw: bytes, last: str) -> bytes:
        """The batch with its final event's `details.migrations` set."""
        event = parse_event(last) or {}
        if isinstance(event.get("details"), dict):
            event["details"]["migrations"] = self.migrations
        start = _last_event_start(raw)
        return raw[:start] + f"data: {json.dumps(event)}\n\n".encode()

    async def _move(self, why: str) -> tuple[bytes, str]:
        """Continue on another worker: its first batch, or `StreamIncomplete`."""
        lost = self.stream
        self._delivered += token_ids(self._segment)
        self._segment = []
        lost.worker.request_outcome(lost.generation, False, why)
        self._exclude[lost.worker.id] = lost.generation
        self.dispatcher.supervisor.report_unreachable(lost.worker, lost.generation)
        with anyio.CancelScope(shield=True):
            await lost.aclose()
        sent = len(self._delivered)
        lost_msg = f"worker {lost.worker.id} was lost after {sent} tokens ({why}); the generation is incomplete"
        limit = self.dispatcher.settings.migration_limit
        if self.migrations >= limit:
            moved = f"it already moved {self.migrations} times" if limit else "stream migration is off"
            raise StreamIncomplete(f"{lost_msg}: {moved} (--migration-limit {limit})")
        self.dispatcher.metrics.stream_migration(lost.worker)
        note_migration(self.dispatcher.tracing, lost.worker, why, sent)
        logger.warning("stream on worker %s lost after %d tokens (%s); moving it", lost.worker.id, sent, why)
        body = {**self.body, RESUME_IDS: list(self._delivered)}
        try:
            opened = await self.dispatcher.open_stream(self.path, body, self.constraints, self._exclude)
        except DispatchError as e:
            raise StreamIncomplete(f"{lost_msg}: no worker could continue it: {e.message}") from e
        if isinstance(opened, WorkerReply):
            detail = (parse_event(opened.content.decode("utf-8", errors="replace")) or {}).get("error")
            raise StreamIncomplete(f"{lost_msg}: worker {opened.worker.id} refused to continue it "
                                   f"({opened.status}: {detail or 'no message'})")
        self.migrations += 1
        self.stream = opened
        return opened.first_raw, opened.first_data
