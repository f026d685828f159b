"""What the router holds between a worker and a client that reads slower than the worker writes.

Design: `ByteQueue` is a FIFO bounded by the bytes of what it holds. `put` waits while the
queue is over its capacity, so its producer (a task reading a worker stream) stops reading, the
worker's socket fills and the worker's own stream waits: backpressure, end to end, instead of a
buffer that grows for as long as a client does not read (docs/hardening.md). An item always
fits into an empty queue, so one event larger than the capacity still passes. `get_all` hands
over everything there at once, so a consumer that wakes up late writes what piled up in one go.
Trade-off: one task hop per batch of events, for a bound that holds whatever the client does.
"""

from __future__ import annotations

import asyncio
from collections import deque

STREAM_BUFFER_BYTES = 1 << 20  # what one response holds ahead of its client, per worker stream and per merge


class ByteQueue:
    """A FIFO of items, each counted as `nbytes`, at most `capacity` bytes (see the module docstring)."""

    def __init__(self, capacity: int = STREAM_BUFFER_BYTES):
        self.capacity = capacity
        self.nbytes = 0
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item, nbytes: int) -> None:
        """Append `item`, waiting while the queue holds something and `nbytes` more would pass the capacity."""
        while self._items and self.nbytes + nbytes > self.capacity:
            self._space.clear()
            await self._space.wait()
        self._items.append(item)
        self.nbytes += nbytes
        self._ready.set()

    async def get_all(self) -> list:
        """Every item there (waiting for at least one), oldest first."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = list(self._items)
        self._items.clear()
        self.nbytes = 0
        self._space.set()
        return items
