"""Scheduler: join/leave between steps, block tables, chunked prefill, prefix caching and
preemption, driven with hand-built outputs (no model)."""

from __future__ import annotations

import pytest

from workers.engine.scheduler import CapacityError, Scheduler, SchedulerConfig
from workers.engine.sequence import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    RUNNING,
    WAITING,
    Sequence,
)
from workers.sampling.params import SamplingParams

EOS = 1


def sched(max_sequences=2, max_seq_len=64, num_blocks=32, block_size=4, budget=2048, prefix=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_sequences, max_seq_len, num_blocks, block_size, budget, prefix, (EOS,)))


def seq(rid: str, n_prompt=3, max_new=4, first=10) -> Sequence:
    return Sequence(rid, list(range(first, first + n_prompt)), SamplingParams.create(max_new_tokens=max_new))


def step(s: Scheduler, token=7):
    out = s.schedule()
    n = len(out.sampling)
    updates = s.update_from_output(out, [token] * n, [-0.5] * n)
    return out, updates


def run(s: Scheduler, limit=500) -> int:
    steps = 0
    while s.has_unfinished() and steps < limit:
        step(s)
        steps += 1
    return steps


def test_prefill_then_decode_positions_tokens_and_blocks():
    s = sched()
    a = seq("a", n_prompt=5)
    s.add_request(a)
    out, _ = step(s, token=42)
    [c] = out.chunks
    assert (c.start_pos, c.token_ids, c.is_prefill, c.samples) == (0, [10, 11, 12, 13, 14], True, True)
    assert out.num_prefill_tokens == 5 and a.block_ids == [0, 1]  # 5 tokens in blocks of 4
    out, _ = step(s, token=43)
    [c] = out.chunks
    assert (c.start_pos, c.token_ids, c.is_prefill) == (5, [42], False)  # decode of the last token
    assert a.output_ids == [42, 43] and a.num_computed == 6 and c.block_table is a.block_ids


def test_requests_join_between_steps_and_wait_for_the_batch():
    s = sched(max_sequences=2)
    for rid in "abc":
        s.add_request(seq(rid, max_new=2))
    out, _ = step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]  # FCFS, c waits: batch full
    assert s.num_running == 2 and s.num_waiting == 1
    out, updates = step(s)  # a and b reach max_new_tokens=2 and leave
    assert [u.finish_reason for u in updates] == [FINISH_LENGTH, FINISH_LENGTH]
    assert s.kv.num_free_blocks == 32
    out, _ = step(s)  # c joins in the very next step
    assert [(c.seq.request_id, c.is_prefill) for c in out.chunks] == [("c", True)]


def test_decodes_come_first_oldest_first_then_prompts():
    s = sched(max_sequences=3)
    for rid in "ab":
        s.add_request(seq(rid, max_new=8))
    step(s)
    s.add_request(seq("c", max_new=8))
    out, _ = step(s)
    assert [(c.seq.request_id, c.is_prefill) for c in out.chunks] == [("a", False), ("b", False), ("c", True)]


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    s = sched(max_sequences=4, max_seq_len=128, num_blocks=64, budget=8)
    s.add_request(seq("a", n_prompt=3, max_new=20))
    step(s)
    long = seq("long", n_prompt=30, max_new=2, first=100)
    s.add_request(long)
    chunks = []
    while long.status == WAITING or long.num_computed < 30:
        out, _ = step(s)
        assert out.chunks[0].seq.request_id == "a" and not out.chunks[0].is_prefill  # a decodes every step
        assert sum(len(c.token_ids) for c in out.chunks) <= 8
        [c] = [c for c in out.chunks if c.seq is long]
        chunks.append((c.start_pos, len(c.token_ids), c.samples))
    assert chunks == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False), (28, 2, True)]
    assert long.output_ids == [7]  # one token, sampled only by the chunk that reached the end


def test_budget_must_cover_a_prompt_chunk_for_newcomers():
    s = sched(max_sequences=4, budget=4)
    for rid in "abcd":
        s.add_request(seq(rid, n_prompt=3, max_new=5))
    out, _ = step(s)
    assert [(c.seq.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 3), ("b", 1)]  # b's first chunk


def test_capacity_reports_blocks_and_tokens():
    s = sched(max_sequences=2, max_seq_len=32, num_blocks=10, block_size=4, prefix=False)
    s.add_request(seq("a", n_prompt=5, max_new=10))
    step(s)
    cap = s.capacity()
    assert cap == {"max_sequences": 2, "max_tokens": 40, "max_seq_len": 32, "kv_block_size": 4,
                   "kv_blocks_total": 10, "kv_blocks_free": 8, "prefix_cache": False, "max_num_batched_tokens": 2048}


def test_eos_finishes_and_frees_the_blocks():
    s = sched()
    s.add_request(seq("a", max_new=10))
    _, updates = step(s, token=EOS)
    assert updates[0].finish_reason == FINISH_EOS
    assert not s.has_unfinished() and s.kv.num_free_blocks == 32


def test_abort_running_and_waiting_frees_blocks_immediately():
    s = sched(max_sequences=1)
    s.add_request(seq("a", n_prompt=9, max_new=10))
    s.add_request(seq("b", max_new=10))
    step(s)
    assert s.kv.num_free_blocks == 29
    assert s.abort_request("b").finish_reason == FINISH_ABORT  # still waiting
    a = s.abort_request("a")
    assert a.finish_reason == FINISH_ABORT and s.kv.num_free_blocks == 32 and not a.block_ids
    assert s.abort_request("a") is None
    assert s.schedule().is_empty


def test_request_that_can_never_fit_names_the_numbers():
    s = sched(max_seq_len=32, num_blocks=32)
    with pytest.raises(CapacityError) as e:
        s.add_request(seq("a", n_prompt=20, max_new=13))
    msg = str(e.value)
    assert "32" in msg and "20 `inputs` tokens" in msg and "13 `max_new_tokens`" in msg
    s.add_request(seq("b", n_prompt=20, max_new=12))  # exactly fits
    small = sched(max_seq_len=512, num_blocks=5, block_size=4)
    with pytest.raises(CapacityError, match=r"<= 20, the whole KV cache of this worker \(5 blocks of 4 tokens\)"):
        small.check_fits(16, 5)
    with pytest.raises(CapacityError):
        s.check_fits(0, 1)


# -- prefix caching -----------------------------------------------------------------------------


def test_shared_prefix_skips_its_full_blocks_and_shares_them():
    s = sched(max_sequences=4)
    a = seq("a", n_prompt=10, max_new=3)  # blocks [10..13] [14..17] [18 19 | ...]
    s.add_request(a)
    step(s)  # a's two full prompt blocks are now cached
    b = Sequence("b", list(range(10, 18)) + [99, 98, 97], SamplingParams.create(max_new_tokens=3))
    s.add_request(b)
    out, _ = step(s)
    [cb] = [c for c in out.chunks if c.seq is b]
    assert (cb.start_pos, cb.token_ids) == (8, [99, 98, 97])  # computes only its own suffix
    assert (out.num_cached_tokens, out.num_queried_tokens, out.num_prefill_tokens) == (8, 11, 3)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    shared = a.block_ids[:2]
    assert [s.kv.pool.ref_count[x] for x in shared] == [2, 2]
    run(s)
    assert s.kv.num_free_blocks == 32 and s.kv.pool.lookup(b.block_hashes[1]) == shared[1]  # still cached


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = sched()
    s.add_request(seq("a", n_prompt=8, max_new=1))
    run(s)
    again = seq("again", n_prompt=8, max_new=1)
    s.add_request(again)
    out, _ = step(s)
    [c] = out.chunks
    assert (c.start_pos, c.token_ids, c.samples) == (4, [14, 15, 16, 17], True)  # one block hit, not two
    assert out.num_cached_tokens == 4


def test_prefix_cache_off_computes_everything():
    s = sched(prefix=False)
    s.add_request(seq("a", n_prompt=10, max_new=1))
    run(s)
    s.add_request(seq("b", n_prompt=10, max_new=1))
    out, _ = step(s)
    assert out.chunks[0].start_pos == 0 and (out.num_cached_tokens, out.num_queried_tokens) == (0, 0)
    assert not s.kv.pool.cached


def test_cached_blocks_are_evicted_lru_when_space_is_needed():
    s = sched(max_sequences=1, num_blocks=6)
    s.add_request(seq("a", n_prompt=9, max_new=1, first=10))  # 2 full blocks cached
    run(s)
    s.add_request(seq("b", n_prompt=9, max_new=1, first=50))  # 2 more
    run(s)
    s.add_request(seq("c", n_prompt=13, max_new=1, first=90))  # needs 4 blocks: evicts a's (the oldest)
    run(s)
    s.add_request(seq("b2", n_prompt=9, max_new=1, first=50))
    out, _ = step(s)
    assert out.num_cached_tokens == 8  # b's prefix survived, a's did not
    s.add_request(seq("a2", n_prompt=9, max_new=1, first=10))
    out, _ = step(s)
    assert out.num_cached_tokens == 0 and s.kv.pool.evictions >= 2


# -- preemption -------------------------------------------------------------------------------


def test_block_shortage_preempts_the_newest_and_requeues_it_first():
    s = sched(max_sequences=3, num_blocks=6, prefix=False)  # 24 token positions
    a, b, c = seq("a", n_prompt=4, max_new=12), seq("b", n_prompt=4, max_new=12), seq("c", n_prompt=4, max_new=12)
    for x in (a, b, c):
        s.add_request(x)
    step(s)  # 3 prompts x 1 block; first tokens sampled
    step(s)  # each decode needs a 2nd block at position 4: 6 blocks in use
    assert s.kv.num_free_blocks == 0
    outs = [step(s)[0] for _ in range(4)]  # positions 5..8: a needs a 3rd block at 8
    # the newest went
    assert [o.preempted for o in outs] == [(), (), (), (c,)] and c.status == WAITING and s.waiting[0] is c
    assert c.num_computed == 0 and not c.block_ids and len(c.output_ids) == 5  # its tokens stay
    assert a.status == b.status == RUNNING and s.num_preemptions == 1
    run(s)
    assert [len(x.output_ids) for x in (a, b, c)] == [12, 12, 12]
    assert s.kv.num_free_blocks == 6


def test_a_lone_sequence_is_never_preempted_and_the_oldest_always_progresses():
    s = sched(max_sequences=4, num_blocks=8, prefix=False)  # 32 positions
    seqs = [seq(str(i), n_prompt=6, max_new=24) for i in range(4)]  # 30 tokens each: one at a time fits
    for x in seqs:
        s.add_request(x)
    progress = []
    for _ in range(2000):
        if not s.has_unfinished():
            break
        step(s)
        progress.append(len(seqs[0].output_ids))
    assert not s.has_unfinished() and all(len(x.output_ids) == 24 for x in seqs)
    assert progress == sorted(progress)  # the oldest never lost a token
    assert s.num_preemptions > 0 and s.kv.num_free_blocks == 8


def test_finish_of_a_preempted_waiting_sequence():
    s = sched(max_sequences=2, num_blocks=3, prefix=False)
    a, b = seq("a", n_prompt=4, max_new=8), seq("b", n_prompt=4, max_new=8)
    s.add_request(a)
    s.add_request(b)
    while b.status != WAITING or not b.output_ids:
        step(s)
    s.finish(b, FINISH_STOP)
    assert b.status == "finished" and b not in s.waiting
    run(s)
    assert len(a.output_ids) == 8 and s.kv.num_free_blocks == 3
