"""The host tier's background writer (workers/kvtier/writer.py): off the step's path, bounded."""

from __future__ import annotations

import threading

from workers.kvtier.writer import TierWriter


def test_a_full_queue_drops_the_block_instead_of_waiting_and_a_queued_one_is_readable():
    """Guards the capacity check in `TierWriter.submit`: a blocking put would stall the engine step."""
    gate, taken, stored = threading.Event(), threading.Event(), {}

    def put(h, payload):
        taken.set()
        gate.wait(10)
        stored[h] = payload
        return True

    writer = TierWriter(put, capacity=2)
    assert writer.submit(b"a", b"1")
    assert not writer.submit(b"a", b"1"), "a block already queued is not queued twice"
    assert taken.wait(10)  # the thread holds "a": the queue is empty again
    assert writer.submit(b"b", b"2") and writer.submit(b"c", b"3")  # one taken by the thread, two queued
    assert not writer.submit(b"d", b"4") and writer.dropped == 1
    assert writer.peek(b"b") == b"2", "a block waiting in the queue is served from it"
    gate.set()
    writer.close()
    assert {b"a", b"b", b"c"} <= set(stored) and writer.peek(b"b") is None


def test_a_failing_write_loses_one_block_not_the_writer():
    calls = []

    def put(h, payload):
        calls.append(h)
        if h == b"bad":
            raise OSError("disk gone")
        return True

    writer = TierWriter(put)
    writer.submit(b"bad", b"x")
    writer.submit(b"good", b"y")
    writer.close()
    assert calls == [b"bad", b"good"]


def test_blocks_queued_during_a_step_wait_for_its_end():
    """Guards `if wake:` in `TierWriter.submit`: blocks cached mid-step are written only once the
    step ends (`wake`), so the thread does not contend with the step for the interpreter."""
    stored = []
    writer = TierWriter(lambda h, payload: stored.append(h) or True)
    assert writer.submit(b"a", b"1", wake=False)
    threading.Event().wait(0.3)
    assert stored == [] and writer.peek(b"a") == b"1", "queued, readable, not written yet"
    writer.wake()
    writer.flush()
    assert stored == [b"a"] and writer.peek(b"a") is None
    writer.close()
