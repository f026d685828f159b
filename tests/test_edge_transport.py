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
