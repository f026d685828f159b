"""The router's Unix-socket HTTP client against a scripted server: bodies, reuse, failures."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest

from server.fleet.client import SSEEvents, split_events
from server.fleet.uds_http import UnixHTTPPool, WorkerConnectError, WorkerConnectionLost


async def _serve(handler):
    """A Unix-socket server running `handler(reader, writer)` per connection; returns (path, server, conns)."""
    path = os.path.join(tempfile.mkdtemp(), "w.sock")
    conns = []

    async def on_conn(reader, writer):
        conns.append(writer)
        await handler(reader, writer)

    server = await asyncio.start_unix_server(on_conn, path)
    return path, server, conns


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return await reader.readexactly(length)


def test_content_length_and_chunked_bodies_on_one_kept_alive_connection():
    async def handler(reader, writer):
        while not reader.at_eof():
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if body == b"chunked":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Worker-Id: gpu0\r\n\r\n"
                             b"5\r\nhello\r\n6; ext=1\r\n world\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main():
        path, server, conns = await _serve(handler)
        pool = UnixHTTPPool(path)
        assert await pool.request("POST", "/x", b"echo me") == (201, {"content-length": "7"}, b"echo me")
        status, headers, body = await pool.request("POST", "/x", b"chunked")
        assert (status, body, headers["x-worker-id"]) == (200, b"hello world", "gpu0")
        await pool.request("POST", "/x", b"again")
        await pool.aclose()
        server.close()
        return len(conns)

    assert asyncio.run(main()) == 1  # three requests, one connection


def test_an_idle_connection_the_server_closed_is_replaced_transparently():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # the server drops the keep-alive connection

    async def main():
        path, server, conns = await _serve(handler)
        pool = UnixHTTPPool(path)
        first = await pool.request("GET", "/health")
        await asyncio.sleep(0.05)
        second = await pool.request("GET", "/health")
        server.close()
        return first, second, len(conns)

    first, second, n = asyncio.run(main())
    assert first[2] == second[2] == b"ok" and n == 2


def test_a_worker_that_dies_mid_body_is_connection_lost_and_no_socket_is_connect_error():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()
        writer.transport.abort()

    async def main():
        path, server, _ = await _serve(handler)
        pool = UnixHTTPPool(path)
        with pytest.raises(WorkerConnectionLost):
            await pool.request("POST", "/generate", b"{}")
        server.close()
        await server.wait_closed()
        os.unlink(path)
        with pytest.raises(WorkerConnectError):
            await pool.request("GET", "/health")

    asyncio.run(main())


def test_sse_events_are_split_across_chunk_boundaries():
    async def chunks():
        for part in (b'data: {"index": 0}\n', b'\ndata: {"index": 1}\n\ndata: {"in', b'dex": 2}\n\n'):
            yield part

    async def main():
        sse = SSEEvents(chunks())
        batches = []
        while (batch := await sse.next_batch()) is not None:
            batches.append(batch)
        return batches

    batches = asyncio.run(main())
    # events 0 and 1 complete in the same chunk: one batch, relayed as one write
    assert [last for _, last in batches] == ['{"index": 1}', '{"index": 2}']
    assert split_events(batches[0][0]) == ['{"index": 0}', '{"index": 1}']
    assert b"".join(raw for raw, _ in batches) == b'data: {"index": 0}\n\ndata: {"index": 1}\n\ndata: {"index": 2}\n\n'
