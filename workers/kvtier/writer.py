"""The tier's writer: blocks are written to the store by one background thread, off the step's path.

Design: the engine thread copies a block out of the device pool (a cheap copy on the CPU; on a
GPU it would be a copy on a side stream into pinned memory) and hands the copy to a bounded
queue; the writer thread computes its checksum and writes its file. A block still in the queue
is served from the queue (`pending`), so a lookup right after a block was cached finds it. When
the queue is full the block is dropped and counted, never waited for: a missing block costs a
recompute later, a waiting step costs every running sequence now. Trade-off: at most
`QUEUE_BLOCKS` block copies wait in memory beyond the budget."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

QUEUE_BLOCKS = 256


class TierWriter:
    """`submit(hash, payload)` from the engine thread; `put(hash, payload)` runs on the writer."""

    def __init__(self, put: Callable[[bytes, object], bool], capacity: int = QUEUE_BLOCKS) -> None:
        self._put = put
        self._queue: queue.Queue = queue.Queue(capacity)
        self.pending: dict[bytes, object] = {}
        self._lock = threading.Lock()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, chain_hash: bytes, payload) -> bool:
        """Queue one block; False (dropped, counted) when the queue is full or already holds it."""
        with self._lock:
            if chain_hash in self.pending:
                return False
            try:
                self._queue.put_nowait((chain_hash, payload))
            except queue.Full:
                self.dropped += 1
                return False
            self.pending[chain_hash] = payload
        return True

    def peek(self, chain_hash: bytes):
        """A queued block's payload, or None."""
        with self._lock:
            return self.pending.get(chain_hash)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                chain_hash, payload = item
                try:
                    self._put(chain_hash, payload)
                except Exception:  # a failed write loses one block, never the writer
                    logger.exception("host KV tier: writing a block failed")
                with self._lock:
                    self.pending.pop(chain_hash, None)
            finally:
                self._queue.task_done()
