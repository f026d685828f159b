"""A lean HTTP/1.1 client over a Unix socket: keep-alive pool, Content-Length and chunked bodies.

The router's hot path is "forward one request to a worker, relay its answer". A general client
(httpx) costs more CPU per request and per streamed chunk than the rest of the router together,
and on a host where the router shares cores with the workers that CPU is taken from generation.
The workers are ours and speak plain HTTP/1.1 (uvicorn), so this client handles exactly that:
one request per connection at a time, idle connections reused (dropped before the server's
keep-alive timeout), bodies by Content-Length or chunked transfer encoding. Failures are two
exceptions: `WorkerConnectError` (nothing listens: the worker is down) and
`WorkerConnectionLost` (the connection broke mid-exchange). Trade-off: no redirects, TLS,
HTTP/2 or proxies, none of which a local worker socket needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping

_IDLE_MAX_S = 4.0  # uvicorn closes idle keep-alive connections after 5 s
_MAX_IDLE = 64
_HEAD_LIMIT = 64 * 1024


class WorkerConnectError(ConnectionError):
    """Could not connect to the worker's socket."""


class WorkerConnectionLost(ConnectionError):
    """The connection to the worker broke before its answer was complete."""


class _Conn:
    __slots__ = ("reader", "writer", "idle_since", "reused", "closed")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0
        self.reused = False
        self.closed = False

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            self.writer.close()


class Response:
    """Status and headers; the body is read with `read()` or `iter_chunks()`, then the
    connection goes back to the pool (or is closed) by `aclose()`."""

    def __init__(self, pool: UnixHTTPPool, conn: _Conn, status: int, headers: dict[str, str], head_only: bool):
        self._pool, self._conn = pool, conn
        self.status_code, self.headers = status, headers
        self._done = head_only
        self._reusable = headers.get("connection", "").lower() != "close"
        self._closed = False
        length = headers.get("content-length")
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._length = int(length) if length is not None and not self._chunked else None
        if self._length is None and not self._chunked:
            self._reusable = False  # body runs to EOF

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        reader = self._conn.reader
        try:
            if self._done:
                return
            if self._chunked:
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the end
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left > 0:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                while data := await reader.read(65536):
                    yield data
            self._done = True
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            self._reusable = False
            raise WorkerConnectionLost(f"connection lost while reading the body: {e!r}") from e

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_chunks()]
        await self.aclose()
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool._release(self._conn, self._reusable and self._done)


class UnixHTTPPool:
    """Requests to one Unix socket, reusing idle keep-alive connections."""

    def __init__(self, path: str):
        self.path = path
        self._idle: deque[_Conn] = deque()
        self._busy: set[_Conn] = set()  # connections with a request under way
        self._closed = False

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=_HEAD_LIMIT)
        except OSError as e:
            raise WorkerConnectError(f"cannot connect to {self.path}: {e.strerror or e!r}") from e
        return _Conn(reader, writer)

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < _IDLE_MAX_S and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn, reusable: bool) -> None:
        self._busy.discard(conn)
        if reusable and not conn.closed and not self._closed and len(self._idle) < _MAX_IDLE:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    async def send(self, method: str, path: str, body: bytes | None = None,
                   content_type: str = "application/json", headers: Mapping[str, str] | None = None) -> Response:
        """Send a request (with extra `headers`, e.g. the trace context); return once the
        status line and headers have arrived.

        A reused idle connection that turns out closed before any byte of the answer is retried
        once on a fresh connection, as the server may close idle connections at any time; when
        nothing listens any more for that retry, the first failure is what is raised (the
        connection broke under the request: the worker may have died of it, which the dispatcher
        must count as a death under it, not as a worker that was already down)."""
        head = f"{method} {path} HTTP/1.1\r\nHost: worker\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        payload = head.encode("latin-1") + b"\r\n" + (body or b"")
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, method, payload)
            except WorkerConnectionLost as lost:  # a stale idle connection: once more on a fresh one
                try:
                    fresh = await self._connect()
                except WorkerConnectError:  # the worker is gone since: it may have died of this request
                    raise lost from None
                return await self._exchange(fresh, method, payload)
        return await self._exchange(await self._connect(), method, payload)

    async def _exchange(self, conn: _Conn, method: str, payload: bytes) -> Response:
        self._busy.add(conn)
        try:
            conn.writer.write(payload)
            await conn.writer.drain()
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self._release(conn, False)
            raise WorkerConnectionLost(f"no answer from the worker: {e!r}") from e
        except BaseException:
            self._release(conn, False)
            raise
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as e:
            self._release(conn, False)
            raise WorkerConnectionLost(f"malformed status line {lines[0]!r}") from e
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        head_only = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        return Response(self, conn, status, headers, head_only)

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """A whole exchange: (status, headers, body)."""
        response = await self.send(method, path, body, headers=headers)
        try:
            content = await response.read()
        finally:
            await response.aclose()
        return response.status_code, response.headers, content

    def abort(self) -> None:
        """Close every connection, in use or idle: blocked reads fail with `WorkerConnectionLost`
        at once (the supervisor's way of taking a hung worker's requests back)."""
        for conn in list(self._busy):
            conn.close()
        self._busy.clear()
        while self._idle:
            self._idle.pop().close()

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
