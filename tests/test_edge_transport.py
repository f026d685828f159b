"""The public socket's write coalescing and client-gone callbacks (server/edge/http11.py,
server/edge/disconnect.py), on a stand-in transport."""

from __future__ import annotations

import asyncio

from server.edge.disconnect import ClientGone
from server.edge.http11 import CoalescingTransport


class _Transport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str):
        return f"extra {name}"


def test_writes_of_one_iteration_leave_as_one():
    """Guards `CoalescingTransport.write`'s join: a response's head and body went out as two sends."""

    async def run():
        real = _Transport()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"body")
        pending = t.get_write_buffer_size()
        assert real.writes == []  # nothing before the iteration ends
        await asyncio.sleep(0)
        t.write(b"next")
        t.close()  # flushes what is pending first
        t2 = CoalescingTransport(_Transport(), asyncio.get_running_loop())
        t2.write(b"dropped")
        t2.abort()
        await asyncio.sleep(0)
        return real, pending, t2._transport, t.get_extra_info("peername")

    real, pending, aborted, extra = asyncio.run(run())
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"next"] and real.closed and pending == 23
    assert aborted.writes == [] and aborted.aborted
    assert extra == "extra peername"


def test_client_gone_runs_each_callback_once_and_late_ones_at_once():
    gone, calls = ClientGone(), []
    gone.add(lambda: calls.append("a"))
    removed = lambda: calls.append("removed")  # noqa: E731
    gone.add(removed)
    gone.discard(removed)
    gone.fire()
    gone.fire()
    gone.add(lambda: calls.append("late"))
    assert calls == ["a", "late"]


def test_a_client_that_leaves_after_a_large_body_cancels_the_request():
    """Guards `self.flow.resume_reading()` in `EdgeHttpProtocol.on_message_complete`: uvicorn
    pauses reading when one read brings more body than its high-water mark, so without it a
    client that left after such a body was never seen (no `connection_lost`, no `ClientGone`),
    and the request (an embeddings batch on its worker) ran to its end."""
    import socket

    import uvicorn

    from server.edge.disconnect import DisconnectGuard
    from server.edge.http11 import EdgeLimits, edge_protocol

    body = b"x" * 100_000  # over uvicorn's 64 KiB high-water mark, in one read
    outcome: dict[str, object] = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        received = 0
        while True:
            message = await receive()
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        outcome["received"] = received
        try:
            await asyncio.sleep(10)  # the request's long work, never reading `receive` again
            outcome["ended"] = "ran to its end"
        except asyncio.CancelledError:
            outcome["ended"] = "cancelled"
            raise

    async def run():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(DisconnectGuard(app), http=edge_protocol(EdgeLimits()), log_level="warning",
                                lifespan="off")
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(b"POST /embed HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(0.2)  # the app waits in `receive()` (reading resumed) when the body comes
        writer.write(body)
        await writer.drain()
        for _ in range(500):
            if "received" in outcome:
                break
            await asyncio.sleep(0.01)
        writer.close()  # the client leaves without reading an answer
        for _ in range(300):
            if "ended" in outcome:
                break
            await asyncio.sleep(0.01)
        server.should_exit = True
        await serving

    asyncio.run(run())
    assert outcome.get("received") == len(body)
    assert outcome.get("ended") == "cancelled", outcome
