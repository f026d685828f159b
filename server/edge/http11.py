"""The public socket's HTTP/1.1 protocol: head limits, read timeouts, JSON for parser errors.

uvicorn's httptools protocol with what the ASGI app cannot do itself, because it happens before
(or instead of) a request reaching the app: head and target limits (431, 414), read timeouts
for the head and inside a body (408), a write timeout for a client that stops reading (the
connection aborted and the app sees the client gone), and malformed HTTP answered as a JSON 400
naming the parser's reason, in the same `{"error", "error_type"}` shape as every other error;
the limits and flags: docs/serving.md and docs/hardening.md. Trade-off: this subclasses
uvicorn's httptools protocol (pinned with uvicorn), which is less stable an interface than ASGI,
but nothing at the ASGI level can refuse a head that is still arriving.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.config.budgets import WRITE_TIMEOUT_S
from server.config.settings import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, RouterSettings
from server.edge.disconnect import CLIENT_GONE_EXTENSION, ClientGone
from server.edge.errors import error_body
from server.errors import shown
from workers.contract import MAX_HEADER_BYTES, MAX_HEADER_COUNT, MAX_URL_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeLimits:
    """What the public socket accepts before a request reaches the app."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADER_COUNT
    max_url_bytes: int = MAX_URL_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    write_timeout_s: float = WRITE_TIMEOUT_S
    on_write_timeout: Callable[[], None] | None = field(default=None, compare=False)  # counts each one

    @classmethod
    def from_settings(cls, settings: RouterSettings,
                      on_write_timeout: Callable[[], None] | None = None) -> EdgeLimits:
        return cls(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s,
                   write_timeout_s=settings.budgets.write_timeout_s,
                   on_write_timeout=on_write_timeout)


class CoalescingTransport:
    """A connection's transport whose writes of one event loop iteration leave as one: uvicorn
    writes a response's head and its body separately, which would cost a send and a segment (and
    a wake-up of the client) each. The first write of an iteration schedules the flush at the end
    of it, so nothing waits longer than the iteration that wrote it; `close()` flushes first,
    `abort()` drops what is pending, as it drops what the transport buffers. Everything else is
    the transport's own."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending or ()))

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def _client_gone(cycle) -> None:
    """Run the request's client-gone callbacks (server/edge/disconnect.py `ClientGone`)."""
    gone = (cycle.scope.get("extensions") or {}).get(CLIENT_GONE_EXTENSION)
    if gone is not None:
        gone.fire()


class _Reject(Exception):
    """Raised from a parser callback: answer `status` with `message` and close."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def edge_protocol(limits: EdgeLimits) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` with these limits."""
    return type("EdgeHttpProtocol", (EdgeHttpProtocol,), {"limits": limits})


class EdgeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits`:

    - head limits: the parser buffers a header value whole before handing it over, so the size
      is counted per received chunk while the head is incomplete: a head over
      `max_header_bytes`, or more than `max_headers` headers, is answered 431 and the connection
      closed, holding at most the limit plus one chunk; a target over `max_url_bytes`, 414;
    - read timeouts: the head must arrive within `header_timeout_s` of its first byte (or of the
      connection opening), else 408 and close; a body must keep coming: `body_timeout_s` without
      a byte while the app waits for one ends the request with 408 and closes the connection;
    - write timeout: a client that stops reading fills the socket, then the transport's buffer
      past its high-water mark (uvicorn pauses the response); paused for `write_timeout_s`, the
      connection is aborted (its buffered bytes dropped), `on_write_timeout` counts it, and the
      app sees the client gone: a stream is cancelled and its worker request aborted, freeing
      the admission slot and the router's buffers for that response;
    - malformed HTTP: a JSON 400 naming the parser's reason, then close."""

    limits = EdgeLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request head
        self._head_begun = False
        self._head_bytes = 0  # counted per chunk while the head is incomplete
        self._exact_bytes = 0  # request line + headers as parsed
        self._header_count = 0
        self._closed_by_us = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # --- connection -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = CoalescingTransport(transport, self.loop)  # what the request cycles write to
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            _client_gone(cycle)

    def data_received(self, data: bytes) -> None:
        if self._closed_by_us:
            return
        self._unset_keepalive_if_required()
        counted = self._in_head and self._head_begun  # the head began in an earlier chunk
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            reject = e.__context__ if isinstance(e.__context__, _Reject) else None
            if reject is None:
                reject = _Reject(400, f"Invalid HTTP request: {e}")
                logger.info("malformed HTTP from %s: %s", self.client, e)
            self._answer(reject.status, reject.message)
            return
        if self._in_head and counted:
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._answer(431, self._head_too_large())
                return
        if self.cycle is not None and not self._in_head and self.cycle.more_body:
            self._arm_body_timer()

    # --- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {CLIENT_GONE_EXTENSION: ClientGone()}  # server/edge/disconnect.py
        self._head_begun, self._head_bytes, self._exact_bytes, self._header_count = True, 0, 0, 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._exact_bytes += len(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise _Reject(414, f"The request target exceeds {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._exact_bytes += len(name) + len(value) + 4
        if self._header_count > self.limits.max_headers:
            raise _Reject(431, f"The request has more than {self.limits.max_headers} headers")
        if self._exact_bytes > self.limits.max_header_bytes:
            raise _Reject(431, self._head_too_large())
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_begun = False, False
        self._cancel(self._head_timer)
        self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._cancel(self._body_timer)
        self._body_timer = None
        super().on_message_complete()
        # uvicorn pauses reading while a large body waits for the app and resumes only in the
        # app's next `receive()`: with the body whole, read on, so a client that leaves reaches
        # `connection_lost` (its `ClientGone` callbacks) without a task parked in `receive()`.
        # What comes next is a pipelined request, which uvicorn queues and pauses for.
        self.flow.resume_reading()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._in_head and not self._head_begun:
            self._cancel(self._head_timer)  # idle between requests: the keep-alive timeout applies
            self._head_timer = None

    def _head_too_large(self) -> str:
        return f"The request head (request line and headers) exceeds {self.limits.max_header_bytes} bytes"

    # --- timeouts -------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self.limits.header_timeout_s > 0:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _arm_body_timer(self) -> None:
        self._cancel(self._body_timer)
        self._body_timer = None
        if self.limits.body_timeout_s > 0:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if not self._head_begun:
            self.transport.close()  # connected but never sent a byte
            return
        self._answer(408, f"The request head did not arrive within {self.limits.header_timeout_s:g} s")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None or not cycle.more_body:
            return
        if self.flow.read_paused:  # the app has not read what came: not the client's fault
            self._arm_body_timer()
            return
        self._answer(408, f"No request body bytes for {self.limits.body_timeout_s:g} s: the body is incomplete")

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None and self.limits.write_timeout_s > 0:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(self._write_timer)
        self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        logger.warning("client %s read nothing of its answer for %g s: connection aborted, its request cancelled",
                       self.client, self.limits.write_timeout_s)
        if self.limits.on_write_timeout is not None:
            self.limits.on_write_timeout()
        self.transport.abort()  # drops what is buffered for it; connection_lost tells the app

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            self._cancel(timer)
        self._head_timer = self._body_timer = self._write_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    # --- answers the app never sees -------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        self._answer(400, msg)

    def _answer(self, status: int, message: str) -> None:
        """A JSON error written straight to the socket (unless a response already started),
        then close; an app still waiting for the body sees the client gone."""
        self._closed_by_us = True
        self._cancel_timers()
        cycle = self.cycle
        # While a head is read, `cycle` is the previous request's (answered); otherwise an
        # answer already under way (the app answered without reading the body) gets no second one.
        answered = not self._in_head and cycle is not None and cycle.response_started
        if not answered and not self.transport.is_closing():
            path = self._path()
            body = json.dumps(error_body(path, status, message)).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app, if still reading, sees the client gone
            cycle.message_event.set()
            _client_gone(cycle)
        logger.info("answered %d to %s on %s: %s", status, self.client, shown(self._path()), message)
        self.transport.close()

    def _path(self) -> str:
        url = getattr(self, "url", b"") or b""
        return url.split(b"?", 1)[0][:200].decode("latin-1")
