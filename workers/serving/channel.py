"""The router's stream channel: every streamed request's events of a step in one frame.

Why: a streamed response per request costs the event loop a reader wake-up, an SSE write and a
socket write per token per request, Python that contends with the engine thread for the GIL.
Design: the router opens one channel per worker (`GET /streams`, a chunked response); a `POST
/generate_stream` naming it and a stream key (`X-Hetserve-Channel`, `X-Hetserve-Stream`) is
admitted as usual, answered at once with an empty 200, and its events go to the channel's sink
(`RequestStream.redirect`). One task renders whatever the engine delivered since it last woke and
writes one frame: per stream a record `b"<key> <length> <end>\n"` and the SSE bytes
`/generate_stream` would have sent, or, on a channel opened for token ids (`X-Hetserve-Text: ids`),
the events' binary form (workers/contract/events.py), from which the router builds the text. As
vLLM's engine core hands its API server one batch of outputs per step, per-token HTTP work becomes
per-step work. A stream ends with its last event, `POST /streams/abort` or the channel's
connection. Trade-off: the router must demultiplex, and a slow client's bytes wait in the router
rather than in the socket (at most its generation's events)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi.responses import StreamingResponse

from workers.contract import HEADER_CHANNEL, HEADER_TEXT, TEXT_IDS
from workers.contract.errors import ERROR_REQUEST_FAILED
from workers.contract.events import encode_batch
from workers.contract.render import error_frame
from workers.engine.events import ErrorEvent, RequestStream, TokenEvent, is_last

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 0.25  # how often an idle channel looks whether the server is stopping
_ids = itertools.count(1)


LAST, FAILED = "last", "failed"  # how a rendered batch ended its stream


def render_batch(sub, batch: list, path: str) -> tuple[str, str | None]:
    """One request's events as SSE text, and whether that ends its stream: `LAST` (its last event
    came), `FAILED` (rendering raised: this request's fault alone, a `request_failed` error event
    ends its stream and the caller aborts the engine's request) or None."""
    frames = []
    try:
        for e in batch:
            if isinstance(e, ErrorEvent):
                frames.append(error_frame(e.message, e.error_type))
            else:
                frames.append(f"data: {json.dumps(sub.render.event(e))}\n\n")
    except Exception as exc:  # this request only: its last event says so, the worker serves on
        logger.exception("Rendering a stream event failed on %s (this request only)", path)
        frames.append(error_frame(f"Processing the request failed on the worker ({type(exc).__name__}); see its log",
                                  ERROR_REQUEST_FAILED))
        return "".join(frames), FAILED
    return "".join(frames), LAST if is_last(batch[-1]) else None


class StreamChannel:
    """One router connection's streams (see the module docstring); lives on the event loop."""

    def __init__(self, ctx, ids: bool = False):
        self.ctx = ctx
        self.ids = ids  # records are token ids (workers/contract/events.py), not SSE text
        self.id = f"c{next(_ids)}"
        self.streams: dict[int, object] = {}  # key -> `Submitted`
        self.closed = False
        self._pending: list[tuple[int, TokenEvent | ErrorEvent]] = []
        self._wake = asyncio.Event()

    def add(self, key: int, sub) -> None:
        """Carry `sub`'s events from now on (those it already has first)."""
        self.streams[key] = sub

        def sink(_stream: RequestStream, event, pending=self._pending, wake=self._wake) -> None:
            pending.append((key, event))
            wake.set()

        sub.stream.redirect(sink)

    def abort(self, keys) -> int:
        """End these streams (their client left): the engine frees their requests. How many were live."""
        n = 0
        for key in keys:
            sub = self.streams.pop(key, None)
            if sub is not None:
                n += 1
                self._end(sub, None, abort=True)
        return n

    def close(self) -> None:
        """The router's connection is gone: abort every stream still on it."""
        self.closed = True
        self.ctx.channels.pop(self.id, None)
        self.abort(list(self.streams))
        self._pending.clear()

    def _end(self, sub, last, abort: bool) -> None:
        if abort and not sub.stream.ended:
            self.ctx.engine.abort(sub.stream.request_id)
        self.ctx.tracer.end(sub.span, last, sub.stream.request_id, sub.params)

    def _render(self, pending: list) -> list[tuple[int, bytes, bool]]:
        """Per stream with events: (key, its record's bytes, whether that ends it)."""
        by_key: dict[int, list] = {}
        for key, event in pending:
            by_key.setdefault(key, []).append(event)
        records = []
        for key, batch in by_key.items():
            sub = self.streams.get(key)
            if sub is None:  # aborted since the engine made these
                continue
            if self.ids:
                data, ended = encode_batch(batch, sub.start), LAST if is_last(batch[-1]) else None
                if sub.start is not None:  # sent once, with the stream's first record
                    self.streams[key] = sub = replace(sub, start=None)
            else:
                text, ended = render_batch(sub, batch, "/generate_stream")
                data = text.encode()
            records.append((key, data, ended is not None))
            if ended is not None:
                del self.streams[key]
                self._end(sub, batch[-1] if ended == LAST else None, abort=ended == FAILED)
        return records

    async def frames(self, gone: Callable[[], bool]) -> AsyncIterator[list[tuple[int, bytes, bool]]]:
        """Each wake-up's records (one frame's), until the router is `gone()` or the server stops
        with no stream left."""
        while not gone():
            if self._pending:
                pending, self._pending[:] = list(self._pending), []
                frame = self._render(pending)
                if frame:
                    yield frame
                continue
            if not self.streams and self.ctx.stopping():
                return
            self._wake.clear()
            if self.streams:
                await self._wake.wait()
            else:  # idle: look now and then whether the server is stopping
                try:
                    await asyncio.wait_for(self._wake.wait(), _IDLE_CHECK_S)
                except TimeoutError:
                    pass

    def wake_up(self) -> None:
        self._wake.set()


class ChannelResponse(StreamingResponse):
    """`GET /streams`: the channel's frames as one chunked response (pure ASGI below FastAPI)."""

    def __init__(self, channel: StreamChannel):
        headers = {HEADER_CHANNEL: channel.id, "Cache-Control": "no-cache"}
        if channel.ids:
            headers[HEADER_TEXT] = TEXT_IDS  # the router knows its records are token ids
        super().__init__(iter(()), media_type="application/octet-stream", headers=headers)
        self.channel = channel

    async def __call__(self, scope, receive, send) -> None:
        channel = self.channel
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(lambda _: channel.wake_up())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for records in channel.frames(gone.done):
                frame = b"".join(b"%d %d %d\n%s" % (key, len(data), end, data) for key, data, end in records)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            if not gone.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the router went away mid-write
            pass
        finally:
            gone.cancel()
            channel.close()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
