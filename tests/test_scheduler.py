"""Scheduler: join/leave between steps and capacity accounting, driven with hand-built outputs."""

from __future__ import annotations

import pytest

from workers.sampling import SamplingParams
from workers.scheduler import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    CapacityError,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

EOS = 1


def sched(max_sequences=2, max_seq_len=32, max_prefill_tokens=4096) -> Scheduler:
    return Scheduler(SchedulerConfig(max_sequences, max_seq_len, max_prefill_tokens, eos_token_ids=(EOS,)))


def seq(rid: str, n_prompt=3, max_new=4) -> Sequence:
    return Sequence(rid, list(range(10, 10 + n_prompt)), SamplingParams.create(max_new_tokens=max_new))


def step(s: Scheduler, token=7):
    out = s.schedule()
    updates = s.update_from_output(out, [token] * len(out.chunks), [-0.5] * len(out.chunks))
    return out, updates


def test_prefill_then_decode_positions_and_tokens():
    s = sched()
    a = seq("a", n_prompt=3)
    s.add_request(a)
    out, _ = step(s, token=42)
    [c] = out.chunks
    assert (c.slot, c.start_pos, c.token_ids, c.is_prefill) == (0, 0, [10, 11, 12], True)
    assert out.num_prefill_tokens == 3
    out, _ = step(s, token=43)
    [c] = out.chunks
    assert (c.start_pos, c.token_ids, c.is_prefill) == (3, [42], False)  # decode of the last token
    assert a.output_ids == [42, 43] and a.num_computed == 4


def test_requests_join_between_steps_and_wait_for_a_free_slot():
    s = sched(max_sequences=2)
    for rid in "abc":
        s.add_request(seq(rid, max_new=2))
    out, _ = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]  # FCFS, c waits: no slot
    assert s.num_running == 2 and s.num_waiting == 1 and s.num_free_slots == 0
    out, updates = step(s)  # a and b reach max_new_tokens=2 and leave
    assert [u.finish_reason for u in updates] == [FINISH_LENGTH, FINISH_LENGTH]
    assert s.num_free_slots == 2
    out, _ = step(s)  # c takes the lowest freed slot in the very next step
    assert [(c.seq.request_id, c.slot, c.is_prefill) for c in out.chunks] == [("c", 0, True)]


def test_decodes_come_first_in_slot_order_then_prefills():
    s = sched(max_sequences=3)
    for rid in "ab":
        s.add_request(seq(rid, max_new=8))
    step(s)
    s.add_request(seq("c", max_new=8))
    out, _ = step(s)
    assert [(c.seq.request_id, c.slot, c.is_prefill) for c in out.chunks] == [
        ("a", 0, False), ("b", 1, False), ("c", 2, True),
    ]


def test_prefill_budget_limits_prompts_per_step_but_admits_one():
    s = sched(max_sequences=4, max_seq_len=64, max_prefill_tokens=10)
    s.add_request(seq("long", n_prompt=20, max_new=2))
    s.add_request(seq("short1", n_prompt=6, max_new=2))
    s.add_request(seq("short2", n_prompt=6, max_new=2))
    out, _ = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["long"]  # over budget, but first of the step
    out, _ = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["long", "short1"]  # 6 + 6 > 10
    out, _ = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["short1", "short2"]


def test_capacity_accounting_reserved_tokens_and_release():
    s = sched(max_sequences=2, max_seq_len=32)
    assert s.capacity() == {"max_sequences": 2, "max_tokens": 64, "max_seq_len": 32}
    a, b = seq("a", n_prompt=5, max_new=10), seq("b", n_prompt=3, max_new=4)
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert s.reserved_tokens == 15 + 7
    s.finish(a, FINISH_STOP)
    assert s.reserved_tokens == 7 and s.num_free_slots == 1
    s.finish(a, FINISH_STOP)  # idempotent
    assert s.reserved_tokens == 7 and s.num_free_slots == 1


def test_eos_finishes_and_frees_the_slot():
    s = sched()
    s.add_request(seq("a", max_new=10))
    _, updates = step(s, token=EOS)
    assert updates[0].finish_reason == FINISH_EOS
    assert not s.has_unfinished() and s.num_free_slots == 2


def test_abort_running_and_waiting_frees_capacity_immediately():
    s = sched(max_sequences=1)
    s.add_request(seq("a", max_new=10))
    s.add_request(seq("b", max_new=10))
    step(s)
    assert s.abort_request("b").finish_reason == FINISH_ABORT  # still waiting
    a = s.abort_request("a")
    assert a.finish_reason == FINISH_ABORT and s.num_free_slots == 1 and s.reserved_tokens == 0
    assert s.abort_request("a") is None
    assert s.schedule().is_empty


def test_request_that_can_never_fit_names_the_numbers():
    s = sched(max_seq_len=32)
    with pytest.raises(CapacityError) as e:
        s.add_request(seq("a", n_prompt=20, max_new=13))
    msg = str(e.value)
    assert "32" in msg and "20 `inputs` tokens" in msg and "13 `max_new_tokens`" in msg
    s.add_request(seq("b", n_prompt=20, max_new=12))  # exactly fits
    with pytest.raises(CapacityError):
        s.check_fits(0, 1)
