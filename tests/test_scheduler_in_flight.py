"""The scheduler beside batches in flight (a pipeline's, workers/pipeline/engine.py): a sequence
whose step has not landed is neither scheduled again nor preempted, and each batch is capped."""

from __future__ import annotations

from tests.test_scheduler import sched, seq


def _ids(out) -> list[str]:
    return [c.seq.request_id for c in out.chunks]


def test_busy_sequences_are_left_out_and_the_limit_caps_a_batch():
    """Guards `id(seq) in busy` and `len(chunks) >= limit` in `Scheduler.schedule`: without them
    the second batch would schedule the first batch's sequences again, or take them all."""
    s = sched(max_sequences=4)
    for i in range(4):
        s.add_request(seq(f"r{i}"))
    first = s.schedule(limit=2)
    assert _ids(first) == ["r0", "r1"]
    busy = frozenset(id(c.seq) for c in first.chunks)
    second = s.schedule(busy, limit=2)
    assert _ids(second) == ["r2", "r3"]
    assert s.schedule(busy | {id(c.seq) for c in second.chunks}, limit=2).is_empty  # everyone is in flight
    n = len(first.sampling)
    s.update_from_output(first, [7] * n, [-0.5] * n)  # the first batch lands: its sequences decode next
    assert _ids(s.schedule(frozenset(id(c.seq) for c in second.chunks), limit=2)) == ["r0", "r1"]


def test_a_sequence_in_flight_is_never_the_victim_of_a_preemption():
    """Guards `scheduled = set(busy)`: a shortage of blocks preempts a sequence that is not in
    flight, never one whose step is on its way (its blocks are being written by the stages)."""
    s = sched(max_sequences=2, num_blocks=3, block_size=4, budget=64)
    s.add_request(seq("old", n_prompt=8, max_new=4))
    s.add_request(seq("new", n_prompt=4, max_new=4))
    out = s.schedule()
    s.update_from_output(out, [7, 7], [-0.5, -0.5])  # old holds 2 blocks, new 1: all 3 taken, each needs one more
    in_flight = s.schedule(limit=1, busy=frozenset({id(s.running[1])}))  # "new" is in flight; old needs a block
    assert [p.request_id for p in in_flight.preempted] == ["old"]  # it preempts itself, not "new"
    assert [q.request_id for q in s.running] == ["new"]
    without = sched(max_sequences=2, num_blocks=3, block_size=4, budget=64)  # the same, nothing in flight
    without.add_request(seq("old", n_prompt=8, max_new=4))
    without.add_request(seq("new", n_prompt=4, max_new=4))
    out = without.schedule()
    without.update_from_output(out, [7, 7], [-0.5, -0.5])
    assert [p.request_id for p in without.schedule(limit=1).preempted] == ["new"]  # the newest goes
