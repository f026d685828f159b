"""What the engine hands the HTTP side for each request: token events, the finish, errors, and the
per-request stream that carries them across threads.

Design: frozen values (workers/contract/events.py) made on the engine thread and read on the event
loop (workers/contract/render.py renders them, or the channel sends them as token ids). `deliver`
hands one step's events to each event loop in one batch, one `call_soon_threadsafe` per step, not
one per token; events made on the loop's own thread (an idle engine's first step) are pushed at
once, and without a loop (tests driving `Engine.step()`) they collect in `RequestStream.events`. A
stream on the router's channel is `redirect`ed to the channel's sink (workers/serving/channel.py).
Trade-off: a response reads its events in `batches()`, whatever arrived while it was writing, so
tokens of one step go out together rather than each as soon as it exists."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from workers.contract.events import (  # noqa: F401 (the engine's event values, defined in the contract)
    ErrorEvent,
    FinishInfo,
    RequestTimings,
    TokenEvent,
    is_last,
)


class RequestStream:
    """The HTTP side's end of one request: `async for event in stream` until a `finish` or an
    `ErrorEvent`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self.loop = loop
        self.prefill_started: float | None = None  # monotonic start of the step that produced the first token
        self.ended = False  # its last event (a finish or an error) has been handed over
        self.seed: int | None = None  # the seed its sampling uses (drawn when the request gave none)
        self.events: list[TokenEvent | ErrorEvent] = []
        self._queue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._sink: Callable[[RequestStream, TokenEvent | ErrorEvent], None] | None = None

    def push(self, event: TokenEvent | ErrorEvent) -> None:
        """Called on the stream's loop (or directly without one)."""
        if self._sink is not None:
            self._sink(self, event)
        elif self._queue is None:
            self.events.append(event)
        else:
            self._queue.put_nowait(event)

    def redirect(self, sink: Callable[[RequestStream, TokenEvent | ErrorEvent], None]) -> None:
        """From now on hand every event to `sink(stream, event)` instead of queueing it (on the
        stream's loop); the events already queued go to it first, in order."""
        pending = self.events if self._queue is None else []
        while self._queue is not None and not self._queue.empty():
            pending.append(self._queue.get_nowait())
        self.events, self._sink = [], sink
        for event in pending:
            sink(self, event)

    async def __aiter__(self):
        while True:
            event = await self._queue.get()
            yield event
            if is_last(event):
                return

    async def batches(self):
        """The events in lists: each list what has arrived when the reader wakes up (at least
        one event), the last one ending with the finish or an error. A reader that falls behind
        the engine by several steps catches up in one write instead of one per token."""
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while not is_last(batch[-1]) and not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
            if is_last(batch[-1]):
                return


def _push_all(items: list[tuple[RequestStream, TokenEvent | ErrorEvent]]) -> None:
    for stream, event in items:
        stream.push(event)


def deliver(items: list[tuple[RequestStream, TokenEvent | ErrorEvent]]) -> None:
    """Hand `(stream, event)` pairs to their streams: one callback per event loop."""
    here = asyncio._get_running_loop()  # this thread's running loop, if any (a C-level lookup)
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, event in items:
        if is_last(event):
            stream.ended = True
        if stream.loop is None or stream.loop is here:  # no loop, or this thread's: push now
            stream.push(event)
        else:
            by_loop.setdefault(stream.loop, []).append((stream, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, batch)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass
