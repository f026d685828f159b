"""A hybrid's prefix reused through snapshots of its linear layers' state (workers/kv/snapshots.py,
the block manager's `_at_snapshot` and the scheduler's chunks through `KVCacheManager.chunk`): the same greedy tokens as
recomputing everything, on the device, through the host tier on a second engine, after a
preemption, and past a corrupted snapshot; and the policy's bookkeeping on its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.prefill_count import count_prefill
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.hashing import root_hash
from workers.kv.snapshots import INTERVAL_BLOCKS, Snapshots, plan_snapshots
from workers.kv.state import StatePool
from workers.kvtier.store import HEADER_BYTES
from workers.kvtier.tier import HostTier
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

BLOCK, RUNNING, NEW = 4, 2, 10
ROOT = root_hash("snapshots", "float32", "none", BLOCK)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    torch.set_num_threads(1)
    return load_model(make_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5")), "float32")


class Counted:
    """An engine on the hybrid whose computed prefill tokens are summed; `snapshots` spare slots
    (0: no prefix cache, as before snapshots), a host tier in `tier_dir` if given."""

    def __init__(self, lm, snapshots: int, tier_dir=None, blocks: int = 48):
        pool = lm.model.new_kv_pool(blocks, BLOCK, state_slots=RUNNING + snapshots)
        config = SchedulerConfig(RUNNING, 512, blocks, BLOCK, 24, True, eos_token_ids=(), cache_root=ROOT,
                                 state_slots=RUNNING, state_snapshots=snapshots)
        self.engine = Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=4)
        self.tier = None
        if tier_dir is not None:
            self.tier = HostTier.open(pool, ROOT, tier_dir, 1 << 24)
            assert self.tier.enabled, self.tier.reason
            self.engine.attach_tier(self.tier)
        count_prefill(self)

    def generate(self, *prompts: list[int]) -> list[list[int]]:
        streams = [self.engine.submit(p, SamplingParams.create(max_new_tokens=NEW)) for p in prompts]
        while self.engine.step():
            pass
        if self.tier is not None:
            self.tier.flush()
        return [[e.token_id for e in s.events] for s in streams]


def _prompts(n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 4096, (length,), generator=gen).tolist() for length in (30, 45, 21)[:n]]


def conversations(engine: Counted, turns: int, history: list[list[int]] | None = None) -> tuple[list, list]:
    """Conversations taking turns one request at a time: every turn's output, and the histories."""
    history = [list(h) for h in (history or _prompts())]
    outputs = []
    for turn in range(turns):
        for c in range(len(history)):
            (out,) = engine.generate(history[c])
            outputs.append(out)
            history[c] = history[c] + out + [7, 8, 9 + turn]
    return outputs, history


def test_a_hybrid_reuses_its_conversations_prefixes_through_snapshots_with_the_same_greedy_tokens(hybrid):
    """Three conversations of three turns on Qwen3.5 (three linear layers, one full): with eight
    snapshot slots every later turn restores the state at its last block boundary and computes
    fewer prefill tokens, with the greedy tokens of recomputing everything. Guards the
    `snapshots.restore` line of `KVCacheManager.admit` (without it a restored prefix runs on a
    recycled slot's state) and the `snapshots.save` line of `cache_full_blocks` (nothing to restore)."""
    recompute, fresh = Counted(hybrid, 0), Counted(hybrid, 8)
    want, _ = conversations(recompute, 3)
    got, _ = conversations(fresh, 3)
    assert got == want
    described = fresh.engine.scheduler.capacity()
    assert described["prefix_cache"] and not recompute.engine.scheduler.capacity()["prefix_cache"]
    snaps = described["state_snapshots"]
    assert snaps["restored"] == 6 and snaps["slots"] == 8 and snaps["bytes_each"] > 0, snaps
    assert fresh.prefill < recompute.prefill * 0.7, (fresh.prefill, recompute.prefill)


def test_a_second_engine_continues_a_hybrids_conversation_from_the_tier(hybrid, tmp_path):
    """One engine serves the first turn; a fresh engine on the same tier directory serves the
    second from the blocks and the state snapshots the first wrote (its device holds none), with
    the greedy tokens of recomputing everything; a snapshot file corrupted on disk is refused by
    its checksum and that conversation recomputed from an earlier boundary or from the start, alike.
    Guards `HostTier.put_state` / `fetch_state` / `load_state` and the `persist` in `free`."""
    want, _ = conversations(Counted(hybrid, 0), 2)
    first = Counted(hybrid, 4, tmp_path)
    turn1, history = conversations(first, 1)
    assert first.tier.describe()["state_snapshots_written"] >= 3
    second = Counted(hybrid, 4, tmp_path)
    turn2, _ = conversations(second, 1, history)
    assert turn1 + turn2 == want
    assert second.tier.describe()["state_snapshots_loaded"] == 3
    full = sum(len(h) for h in history)
    assert second.prefill < full // 3, (second.prefill, full)

    third = Counted(hybrid, 4, tmp_path)
    store = third.tier.store
    for f in store.dir.iterdir():  # every snapshot's payload altered (the files of a snapshot's size)
        if f.stat().st_size == HEADER_BYTES + third.tier.format.state_bytes:
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
    turn2_again, _ = conversations(third, 1, history)
    assert turn2_again == turn2
    assert store.describe()["blocks_refused"] >= 1 and third.tier.describe()["state_snapshots_loaded"] < 3


def test_a_preempted_hybrid_resumes_from_its_last_boundary_with_the_same_tokens(hybrid, tmp_path):
    """Two long prompts in a pool too small for both to finish: the newer one is preempted, its
    blocks swapped to the host tier, and its resume reads them back and restores its state at its
    last boundary (the snapshot left in a spare slot; the tier's copy after a device eviction),
    recomputing less than a block per preemption, with the greedy tokens of a pool large enough
    for both; without a tier (its blocks partly evicted on the device, so no snapshot may match)
    the same tokens. Guards the `snapshot_key` the sequence keeps through `free`."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4096, (60,), generator=gen).tolist() for _ in range(2)]
    want = Counted(hybrid, 0, blocks=64).generate(*prompts)
    for tier_dir in (None, tmp_path):
        small = Counted(hybrid, 4, tier_dir, blocks=30)
        assert small.generate(*prompts) == want
        sched = small.engine.scheduler
        assert sched.num_preemptions >= 1
    assert sched.kv.snapshots.restored >= 1 and small.tier.describe()["blocks_loaded"] >= 1
    assert sched.num_recomputed_tokens < BLOCK * sched.num_preemptions, sched.num_recomputed_tokens


def test_prompt_chunks_end_on_block_boundaries_and_a_handed_off_prompt_stops_at_its_last(hybrid):
    """A hybrid's prompt chunk that is not its last ends on a block boundary (where a snapshot can
    be taken), and a prompt published for another worker, or one of `LAST_BOUNDARY_BLOCKS` blocks
    or more, stops at its last boundary first; without snapshots the budget alone cuts. Guards
    `KVCacheManager.chunk`."""
    def chunks(snapshots: int, publish: bool, length: int = 57) -> list[tuple[int, int]]:
        engine = Counted(hybrid, snapshots).engine
        seq = engine.submit(list(range(3, 3 + length)), SamplingParams.create(max_new_tokens=1))
        sched = engine.scheduler
        engine._drain_inbox()
        sched.waiting[0].publish_kv = publish
        seen = []
        while True:
            out = sched.schedule()
            if out.is_empty:
                break
            seen += [(c.start_pos, len(c.token_ids)) for c in out.chunks]
            engine._update(out, [c.seq for c in out.chunks if c.samples], None, engine.runner.execute(out),
                           0.0)
        assert seq.events
        return seen

    assert chunks(0, False) == [(0, 24), (24, 24), (48, 9)]  # the budget: 24 tokens a step
    assert chunks(4, False) == [(0, 24), (24, 24), (48, 9)]  # 24 and 48 are boundaries already
    assert chunks(4, True) == [(0, 24), (24, 24), (48, 8), (56, 1)]  # 56: the last boundary of 57
    assert chunks(4, False, 70) == [(0, 24), (24, 24), (48, 20), (68, 2)]  # 16 blocks or more: 68 first
    assert chunks(0, False, 70) == [(0, 24), (24, 24), (48, 22)]


def test_rolling_snapshots_replace_each_other_kept_ones_stay_and_the_oldest_is_evicted():
    """The bookkeeping alone, on a real state pool: a sequence's rolling snapshot moves to its next
    boundary in the same slot; every `INTERVAL_BLOCKS` one is kept (and offered to the tier); with
    every slot held the least recently used goes; `find` takes the longest prefix with a snapshot."""
    pool = StatePool((0,), 4, 2, 2, 1, 1, 1)  # one running slot, three spare
    snaps = Snapshots(1, 3)
    snaps.attach(pool)
    written = []
    tier = SimpleNamespace(put_state=lambda key, slot: written.append(key), fetch_state=lambda key: None)
    seq = SimpleNamespace(state_slot=0, snapshot_key=None)
    pool.recurrent[0, 0] = 1.0
    snaps.save(seq, b"a", 1, tier)
    pool.recurrent[0, 0] = 2.0
    snaps.save(seq, b"b", 2, tier)  # replaces a: one slot used
    assert b"a" not in snaps and b"b" in snaps and snaps.describe()["held"] == 1
    pool.recurrent[0, 0] = 3.0
    snaps.save(seq, b"k", INTERVAL_BLOCKS, tier)  # replaces b, and is kept
    assert written == [b"k"] and b"b" not in snaps
    snaps.save(seq, b"c", INTERVAL_BLOCKS + 1, tier)  # k is kept: c takes another slot
    assert b"k" in snaps and b"c" in snaps
    other = SimpleNamespace(state_slot=0, snapshot_key=None)
    snaps.save(other, b"d", 3, tier)
    snaps.save(SimpleNamespace(state_slot=0, snapshot_key=None), b"e", 5, tier)  # full: k, the oldest, goes
    assert b"k" not in snaps and snaps.evicted == 1
    assert snaps.find([b"x", b"c", b"y", b"d", b"z"], 5, tier) == (4, (b"d", None))
    assert snaps.find([b"x", b"c", b"y", b"d"], 3, tier) == (2, (b"c", None))
    snaps.restore((b"c", None), 0, tier)
    assert float(pool.recurrent[0, 0]) == 3.0  # c was taken when the state was 3
    prompt = SimpleNamespace(state_slot=0, snapshot_key=None)
    snaps.save(prompt, b"p", 2, tier, keep=True)  # a prompt chunk's end: kept, to the tier, not rolled over
    snaps.save(prompt, b"q", 3, tier)
    assert b"p" in snaps and b"q" in snaps and written == [b"k", b"p"]
    assert plan_snapshots(100, 8, 1000) == 2 and plan_snapshots(100, 8, 10**6) == 16 and plan_snapshots(0, 8, 1) == 0


def test_a_hybrids_stream_ended_by_a_shutdown_moves_with_its_state_and_its_resume_recomputes_under_a_block(
        hybrid, tmp_path):  # fmt: skip
    """Guards the `persist` in `KVCacheManager.publish`: when a shutdown ends a running hybrid's
    stream (which the router then moves), its state at its last block boundary is in the tier
    beside its blocks when the error is sent; the engine that continues it (`resume_ids`) restores
    it and recomputes fewer than a block of tokens, going on with the tokens of an undisturbed run."""
    from workers.engine.events import ErrorEvent

    ids, new = _prompts(1)[0], 24
    reference = Counted(hybrid, 0).engine
    ref = reference.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True))
    while reference.step():
        pass
    want = [e.token_id for e in ref.events]
    first, second = Counted(hybrid, 4, tmp_path), Counted(hybrid, 4, tmp_path)
    stream = first.engine.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True))
    for _ in range(9):  # two prompt chunks, then seven decodes
        first.engine.step()
    events, snapshots_at_error = [], []

    def sink(_stream, event):
        events.append(event)
        if isinstance(event, ErrorEvent):
            size = HEADER_BYTES + first.tier.format.state_bytes
            snapshots_at_error.append(sum(f.stat().st_size == size for f in first.tier.store.dir.iterdir()))

    stream.redirect(sink)
    first.engine.start()
    first.engine.shutdown(0.0)
    assert isinstance(events[-1], ErrorEvent), events[-1]
    sent = [e.token_id for e in events[:-1]]
    assert 7 <= len(sent) < new and sent == want[: len(sent)]
    assert snapshots_at_error == [2], "its first chunk's end (kept) and its last boundary's state, before the error"
    resumed = second.engine.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True), resume_ids=sent)
    while second.engine.step():
        pass
    assert sent + [e.token_id for e in resumed.events] == want
    assert 0 < second.prefill <= BLOCK, second.prefill
    assert second.tier.describe()["state_snapshots_loaded"] == 1


def test_a_hybrids_prompt_prefilled_for_another_engine_whole_or_in_part_continues_as_one_engine(hybrid, tmp_path):
    """Disaggregated prefill on a hybrid (server/dispatch/handoff.py's data path): one engine
    prefills the prompt for another (`publish_kv`: its last chunk stops at the last block boundary,
    so the state there is snapshotted, then the tail samples the first token), and the other,
    continuing with that token as `resume_ids`, restores the blocks and the state and computes
    less than a block; or only the first blocks are prefilled elsewhere (Cronus's part) and the
    other computes the rest. Both give one engine's greedy tokens."""
    ids = _prompts(2)[1]  # 45 tokens: 11 full blocks and one token
    alone = Counted(hybrid, 0).generate(ids)[0]
    prefill, decode = Counted(hybrid, 4, tmp_path / "whole"), Counted(hybrid, 4, tmp_path / "whole")
    stream = prefill.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), publish_kv=True)
    while prefill.engine.step():
        pass
    assert [e.token_id for e in stream.events] == alone[:1]
    rest = decode.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), resume_ids=alone[:1])
    while decode.engine.step():
        pass
    assert [e.token_id for e in rest.events] == alone[1:]
    assert decode.prefill <= BLOCK and decode.tier.describe()["state_snapshots_loaded"] == 1, decode.prefill
    part, finish = Counted(hybrid, 4, tmp_path / "part"), Counted(hybrid, 4, tmp_path / "part")
    part.engine.submit(ids[: 8 * BLOCK], SamplingParams.create(max_new_tokens=1), publish_kv=True)
    while part.engine.step():
        pass
    part.tier.flush()
    assert finish.generate(ids) == [alone] and finish.prefill == len(ids) - 8 * BLOCK


def test_deterministic_snapshots_and_rejected_drafts_give_plain_decodings_numbers_bit_for_bit(tmp_path):
    """In deterministic mode (the delta rule token by token) a hybrid's turns served with snapshots
    restored and drafts verified (each draft two right tokens, then two wrong: the state rolled
    back before the boundary's snapshot is taken, workers/engine/speculate.py `_settle`) give the
    tokens and logprobs of recomputing every prompt and decoding plainly, bit for bit."""
    from workers.engine.speculate import Speculator
    from workers.model.deterministic import enable_deterministic
    from workers.spec.policy import SpecPolicy

    torch.set_num_threads(1)
    lm = load_model(make_family_checkpoint("qwen3_5", tmp_path / "q"), "float32")
    enable_deterministic(lm.model)
    want: dict[tuple, list[int]] = {}

    def serve(snapshots: int, drafted: bool) -> tuple[list, Engine]:
        pool = lm.model.new_kv_pool(64, BLOCK, state_slots=RUNNING + snapshots)
        config = SchedulerConfig(RUNNING, 512, 64, BLOCK, 24, True, eos_token_ids=(), cache_root=ROOT,
                                 state_slots=RUNNING, state_snapshots=snapshots)
        speculator = Speculator("ngram", SpecPolicy(4, 8)) if drafted else None
        if speculator is not None:
            def propose(running):
                for seq in running:
                    if seq.output_ids and seq.num_tokens - seq.num_computed == 1:
                        right, n = want[tuple(seq.prompt_ids)], len(seq.output_ids)
                        seq.draft_ids = right[n:n + 2] + [(t + 7) % lm.config.vocab_size for t in right[n + 2:n + 4]]

            speculator.propose = propose
        engine = Engine(ModelRunner(lm.model, pool, "cpu", mirror=False), Scheduler(config), lm.tokenizer,
                        max_queue=4, speculator=speculator)
        history, outputs = _prompts(2), []
        for turn in range(2):
            for c in range(len(history)):
                stream = engine.submit(history[c], SamplingParams.create(max_new_tokens=NEW))
                while engine.step():
                    pass
                out = [(e.token_id, e.logprob) for e in stream.events]
                want.setdefault(tuple(history[c]), [t for t, _ in out])
                outputs.append(out)
                history[c] = history[c] + [t for t, _ in out] + [7, 8, 9 + turn]
        return outputs, engine

    plain, _ = serve(0, False)
    spec, engine = serve(4, True)
    assert spec == plain
    described = engine.speculation()
    assert 0 < described["accepted_tokens"] < described["draft_tokens"], described
    assert engine.scheduler.kv.snapshots.restored >= 2


def test_a_long_prompts_last_boundary_is_kept_so_a_next_turn_without_the_answer_reuses_it(hybrid):
    """A template that drops the answer's reasoning from the history: the next turn shares the
    previous prompt but not what was generated. A prompt of 16 blocks or more stops its prefill at
    its last boundary (snapshotted, kept), so that turn recomputes only the prompt's last partial
    block and its own new tokens, with the greedy tokens of recomputing everything. Guards the
    `LAST_BOUNDARY_BLOCKS` condition of `KVCacheManager.chunk` (else the restore falls back to the
    last chunk end, 48)."""
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 4096, (70,), generator=gen).tolist()
    later = prompt + [11, 12, 13, 14, 15] + [7, 8, 9]  # another "answer" than the one generated
    want = [Counted(hybrid, 0).generate(p)[0] for p in (prompt, later)]
    engine = Counted(hybrid, 8)
    assert engine.generate(prompt) == [want[0]]
    before = engine.prefill
    assert engine.generate(later) == [want[1]]
    assert engine.prefill - before == len(later) - 68, engine.prefill - before
