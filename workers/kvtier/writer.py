"""The tier's writer: blocks are written to the store by one background thread, off the step's path.

Design: the engine thread copies a block out of the device pool (a cheap copy on the CPU; on a
GPU it would be a copy on a side stream into pinned memory) and hands the copy over; the writer
thread computes its checksum and writes its file. A block not written yet is served from memory
(`peek`), so a lookup right after a block was cached finds it. Blocks handed over during a step
are only queued (`submit(..., wake=False)`); the thread is woken once the next step is scheduled
(`wake`), to write while that step's forward runs without the interpreter lock or the engine
idles: a thread woken mid-update takes the lock back and forth with the engine thread for every
block, which on a busy host cost the step (and its first token) far more than the writes.
When the queue is full the block is dropped and counted, never waited for: a missing block costs a
recompute later, a waiting step costs every running sequence now. Trade-off: at most
`QUEUE_BLOCKS` block copies wait in memory beyond the budget."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

QUEUE_BLOCKS = 256


class TierWriter:
    """`submit(hash, payload)` from the engine thread; `put(hash, payload)` runs on the writer."""

    def __init__(self, put: Callable[[bytes, object], bool], capacity: int = QUEUE_BLOCKS) -> None:
        self._put = put
        self.capacity = capacity
        self._queue: collections.deque[bytes] = collections.deque()  # hashes not taken by the thread yet
        self.pending: dict[bytes, object] = {}  # hash -> payload, until its file is written
        self._cond = threading.Condition()
        self._busy = self._closed = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, chain_hash: bytes, payload, wake: bool = True) -> bool:
        """Queue one block (and wake the thread unless `wake` is False: `wake` follows); False
        (dropped, counted) when the queue is full or already holds it."""
        with self._cond:
            if chain_hash in self.pending:
                return False
            if len(self._queue) >= self.capacity:
                self.dropped += 1
                return False
            self.pending[chain_hash] = payload
            self._queue.append(chain_hash)
            if wake or len(self._queue) * 2 >= self.capacity:  # half full: no longer wait for `wake`
                self._cond.notify_all()
        return True

    def wake(self) -> None:
        """Start writing what was queued without waking the thread."""
        with self._cond:
            if self._queue:
                self._cond.notify_all()

    def peek(self, chain_hash: bytes):
        """A queued block's payload, or None."""
        with self._cond:
            return self.pending.get(chain_hash)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        with self._cond:
            self._cond.notify_all()
            while self._queue or self._busy:
                self._cond.wait()

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                chain_hash = self._queue.popleft()
                payload, self._busy = self.pending[chain_hash], True
            try:
                self._put(chain_hash, payload)
            except Exception:  # a failed write loses one block, never the writer
                logger.exception("host KV tier: writing a block failed")
            with self._cond:
                self.pending.pop(chain_hash, None)
                self._busy = False
                if not self._queue:
                    self._cond.notify_all()  # flushers
