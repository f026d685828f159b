"""The engine channel's worker end: submissions, aborts and step frames on one raw Unix socket.

Design: beside its HTTP socket the worker listens on `channel_socket_path` (0600, as the HTTP
socket) for the router's one connection (workers/contract/channel.py). There is no HTTP on this
path at all: a `Submit` is decoded by msgspec, validated once by the contract's `WorkerRequest`
and admitted by the same `WorkerContext.submit` as `POST /generate_stream` (same refusals, sent
back as typed `Rejected` records), and its events leave as the `StreamChannel`'s per-step records
(workers/serving/channel.py) in one `Step` frame per wake-up. So the engine's interpreter spends
nothing per request on uvicorn's parsing, FastAPI's routing and dependency injection or a
handler task, only a frame read and the admission itself. Why a raw socket rather than an
upgraded HTTP connection: uvicorn upgrades only to WebSocket, whose framing and masking would be
a second layer over ours, while a socket beside the HTTP one needs nothing but `asyncio`'s
stream server on the same event loop, and a router that finds no such socket keeps today's HTTP
path. Trade-off: a second socket file per worker, and admissions that wait (a long prompt, a
grammar compiling) run as tasks, so an abort can come before its submission is admitted: the
key is remembered and the request aborted as soon as it is. An `Admitted` answer leaves with the
next `Step` frame (or after `ADMIT_DEFER_S` when none comes first): the router waits for the
stream's first event anyway, and one write wakes it once for both; a refusal leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import replace

from pydantic import ValidationError

from workers.contract import WorkerRequest
from workers.contract.channel import (
    Abort,
    Admitted,
    Open,
    Opened,
    OpenRefused,
    Rejected,
    Step,
    Submit,
    frame,
    frame_length,
    to_worker,
)
from workers.contract.errors import ERROR_REQUEST_FAILED, safe_message
from workers.contract.request import request_error
from workers.serving.channel import StreamChannel
from workers.serving.context import CLIENT_GONE
from workers.serving.errors import APIError

logger = logging.getLogger(__name__)

ADMIT_DEFER_S = 0.05  # the longest an admission answer waits for a step frame to go with
SCORING_ON_STREAM = ("`max_new_tokens` must be an integer >= 1 on `/generate_stream` "
                     "(0, prompt scoring, is answered by `/generate`)")


class EngineChannelServer:
    """The channel socket's server on the worker's event loop; `close()` ends every connection."""

    def __init__(self, ctx, sock: socket.socket, headers: dict[str, str]):
        self.ctx, self.sock, self.headers = ctx, sock, headers
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task, _Connection] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, sock=self.sock)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = connection = _Connection(self.ctx, reader, writer, self.headers)
        try:
            await connection.run()
        finally:
            self._connections.pop(task, None)

    async def close(self) -> None:
        """Stop listening and cut every connection (each ends its streams as a router that left)."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for connection in self._connections.values():
            connection.writer.transport.abort()  # its reader sees the end; cancelling it would be logged
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)


class _Connection:
    """One router connection: reads its messages, admits its submissions, writes its frames."""

    def __init__(self, ctx, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]):
        self.ctx, self.reader, self.writer, self.headers = ctx, reader, writer, headers
        self.channel: StreamChannel | None = None
        self._admitting: dict[int, asyncio.Task] = {}  # keys whose admission is under way, and its task
        self._cancelled: set[int] = set()  # of those, the ones the router aborted meanwhile
        self._tasks: set[asyncio.Task] = set()
        self._gone = False
        self._admitted: list[bytes] = []  # `Admitted` frames waiting for the next step frame
        self._admitted_timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        try:
            first = await self._message()
            if not isinstance(first, Open):
                raise ValueError(f"the first message must be `open`, got `{type(first).__name__}`")
            if not self.ctx.ready:
                self._send(OpenRefused(503, f"Worker `{self.ctx.info.worker_id}` is {self.ctx.status}: not "
                                            "accepting streams", "unavailable"))
                return
            self.channel = StreamChannel(self.ctx, ids=first.ids)
            self._send(Opened(self.channel.id, first.ids, self.headers))
            frames = asyncio.ensure_future(self._write_frames())
            try:
                await self._read()
            finally:
                self._gone = True
                self.channel.wake_up()
                with contextlib.suppress(Exception):
                    await frames
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router went away
        except ValueError as e:
            logger.warning("Closing an engine channel connection: %s", e)
        finally:
            if self.channel is not None:
                self.channel.close()  # every stream still on it is aborted
            for task in list(self._tasks):
                task.cancel()
            self.writer.close()

    async def _message(self):
        body = await self.reader.readexactly(frame_length(await self.reader.readexactly(4)))
        return to_worker(body)

    async def _read(self) -> None:
        """Submissions and aborts until the router closes the connection (or the frames end)."""
        while True:
            try:
                message = await self._message()
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if isinstance(message, Submit):
                if message.key in self.channel.streams or message.key in self._admitting:
                    self._send(Rejected(message.key, 422, f"stream key `{message.key}` is in use on this channel",
                                        "validation"))
                    continue
                task = asyncio.ensure_future(self._admit(message))
                self._admitting[message.key] = task  # now: an abort read before the task runs must find it
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(message, Abort):
                for key in message.keys:
                    if key in self._admitting:  # its grammar compile or tokenization stops with it
                        self._cancelled.add(key)
                        self._admitting[key].cancel()
                self.channel.abort(message.keys)
            else:
                raise ValueError(f"`{type(message).__name__}` after the channel opened")

    async def _write_frames(self) -> None:
        """One `Step` frame per wake-up of the channel; the connection closes when they end (the
        server stops with no stream left)."""
        try:
            async for records in self.channel.frames(lambda: self._gone):
                self.writer.write(self._take_admitted() + frame(Step(records)))
                await self.writer.drain()
        except ConnectionError:
            pass
        finally:
            self.writer.close()

    def _send(self, message) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message))

    def _defer_admitted(self, key: int) -> None:
        """`Admitted(key)`, sent with the next step frame, at the latest after `ADMIT_DEFER_S`."""
        self._admitted.append(frame(Admitted(key)))
        if self._admitted_timer is None:
            self._admitted_timer = asyncio.get_running_loop().call_later(ADMIT_DEFER_S, self._flush_admitted)

    def _take_admitted(self) -> bytes:
        if self._admitted_timer is not None:
            self._admitted_timer.cancel()
            self._admitted_timer = None
        pending, self._admitted = self._admitted, []
        return b"".join(pending)

    def _flush_admitted(self) -> None:
        self._admitted_timer = None
        pending = self._take_admitted()
        if pending and not self.writer.is_closing():
            self.writer.write(pending)

    async def _admit(self, message: Submit) -> None:
        """Admit one submission as `POST /generate_stream` would, answering `Admitted` or `Rejected`."""
        key, ctx, channel = message.key, self.ctx, self.channel
        try:
            sub = await self._submitted(message)
        except asyncio.CancelledError:  # the router aborted it before it was admitted
            self._cancelled.discard(key)
            self._send(Rejected(key, 499, "The request was aborted while it was admitted", CLIENT_GONE))
            return
        except APIError as e:
            self._cancelled.discard(key)
            self._send(Rejected(key, e.status, safe_message(e.message), e.error_type,
                                (e.headers or {}).get("Retry-After")))
            return
        except Exception as e:  # this request only: the worker serves on
            self._cancelled.discard(key)
            logger.exception("Admitting a request from the engine channel failed (this request only)")
            self._send(Rejected(key, 500, f"Processing the request failed on the worker ({type(e).__name__}); "
                                          "see its log", ERROR_REQUEST_FAILED))
            return
        finally:
            self._admitting.pop(key, None)
        if channel.closed or key in self._cancelled:  # the router left, or aborted it meanwhile
            self._cancelled.discard(key)
            ctx.engine.abort(sub.stream.request_id)
            ctx.tracer.end(sub.span, None, sub.stream.request_id, sub.params)
            return
        self._defer_admitted(key)
        channel.add(key, sub)

    async def _submitted(self, message: Submit):
        """The admitted request inside its span (a child of the router's); `APIError` when refused."""
        try:
            req = WorkerRequest.model_validate(message.request)
        except ValidationError as e:
            raise APIError(422, request_error(e.errors()), "validation") from None
        if req.parameters.scoring_only and not message.generate:
            raise APIError(422, SCORING_ON_STREAM, "validation")
        tracer = self.ctx.tracer
        span = tracer.start("/generate" if message.generate else "/generate_stream", message.trace)
        try:
            sub = await self.ctx.submit(req, None, text=not self.channel.ids)
        except APIError as e:
            tracer.end(span, None, refused=e.message)
            raise
        return replace(sub, span=span)
