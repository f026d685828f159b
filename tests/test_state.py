"""The linear layers' state beside the KV cache (workers/kv/state.py): slots held exactly while a
sequence holds blocks, whatever ends it; the pool's sizes; the step's slot layout."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import FINISH_STOP, RUNNING, WAITING, Sequence
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.manager import KVCacheManager
from workers.kv.state import StateBatch, StatePool, StateSlots, plan_state
from workers.model.config import ModelConfig
from workers.sampling.params import SamplingParams

EOS = 1
HYBRID = ModelConfig(architecture="qwen3_5", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, norm_style="gemma", qk_norm="head", attn_output_gate=True,
                     layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel=4)


def _check_slots(s: Scheduler) -> None:
    """Every running sequence holds one slot of its own; no waiting one holds any."""
    held = [x.state_slot for x in s.running]
    assert all(0 <= slot < s.config.state_slots for slot in held) and len(set(held)) == len(held), held
    assert all(x.state_slot == -1 for x in s.waiting)
    assert s.kv.states.num_free == s.config.state_slots - len(held)


def test_no_state_slot_leaks_over_1000_random_requests_finished_aborted_and_preempted():
    """Random prompts and lengths through a pool small enough to preempt, with random EOS, stop
    and client aborts (waiting and running): after every step each running sequence holds exactly
    one distinct slot, and at the end every slot is free. Guards `KVCacheManager.free`'s
    `self.states.give(seq.state_slot)`: without it the slots run out within the first batches."""
    rng = random.Random(0)
    s = Scheduler(SchedulerConfig(4, 96, num_blocks=24, block_size=4, max_num_batched_tokens=32, prefix_caching=True,
                                  eos_token_ids=(EOS,), state_slots=4))
    assert not s.config.prefix_caching  # a model with linear layers reuses no prefix
    submitted = ended = aborted = stopped = 0
    while submitted < 1000 or s.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # requests arrive
            if submitted < 1000:
                n = rng.randint(1, 30)
                x = Sequence(f"r{submitted}", [rng.randint(2, 99) for _ in range(n)],
                             SamplingParams.create(max_new_tokens=rng.randint(1, 40)))
                s.add_request(x)
                submitted += 1
        if rng.random() < 0.05 and s.waiting:  # a client gives up while it waits
            s.abort_request(rng.choice(list(s.waiting)).request_id)
            aborted += 1
        if rng.random() < 0.05 and s.running:  # ... or while it runs
            s.abort_request(rng.choice(s.running).request_id)
            aborted += 1
        if rng.random() < 0.03 and s.running:  # a stop string matched
            s.finish(rng.choice(s.running), FINISH_STOP)
            stopped += 1
        out = s.schedule()
        tokens = [EOS if rng.random() < 0.03 else rng.randint(2, 99) for _ in out.sampling]
        ended += sum(u.finish_reason is not None for u in s.update_from_output(out, tokens, [0.0] * len(tokens)))
        _check_slots(s)
    assert s.kv.states.num_free == 4 and s.kv.num_free_blocks == 24
    assert s.num_preemptions > 50 and aborted > 50 and stopped > 20 and ended > 500  # every path was taken


def test_preemption_gives_the_slot_back_and_readmission_starts_from_a_fresh_state():
    s = Scheduler(SchedulerConfig(3, 64, num_blocks=6, block_size=4, prefix_caching=False, eos_token_ids=(EOS,),
                                  state_slots=3))
    seqs = [Sequence(c, [5, 6, 7, 8], SamplingParams.create(max_new_tokens=12)) for c in "abc"]
    for x in seqs:
        s.add_request(x)
    while not s.num_preemptions:
        out = s.schedule()
        s.update_from_output(out, [9] * len(out.sampling), [0.0] * len(out.sampling))
    victim = seqs[2]
    assert victim.status == WAITING and victim.state_slot == -1 and s.kv.states.num_free == 1
    while victim.status != RUNNING:
        out = s.schedule()
        s.update_from_output(out, [9] * len(out.sampling), [0.0] * len(out.sampling))
    first = next(c for c in out.chunks if c.seq is victim)
    assert first.start_pos == 0 and victim.state_slot >= 0  # recomputed from its first token: a fresh state


def test_a_state_slot_is_needed_to_admit_and_cannot_be_given_twice():
    kv = KVCacheManager(16, 4, prefix_caching=False, state_slots=1)
    a, b = (Sequence(r, [3, 4, 5], SamplingParams.create(max_new_tokens=2)) for r in "ab")
    assert kv.admit(a, 8) is not None and a.state_slot == 0
    assert kv.admit(b, 8) is None and not b.block_ids  # blocks to spare, but no slot: nothing taken
    kv.free(a)
    assert a.state_slot == -1 and kv.admit(b, 8) is not None and b.state_slot == 0
    slots = StateSlots(2)
    slot = slots.take()
    slots.give(slot)
    with pytest.raises(AssertionError, match="not held"):
        slots.give(slot)
    with pytest.raises(ValueError, match="prefix_caching"):
        KVCacheManager(16, 4, prefix_caching=True, state_slots=1)


def test_the_pool_is_sized_from_the_config_and_counted_in_the_budget():
    per = StatePool.bytes_per_sequence(HYBRID, torch.bfloat16)
    conv = HYBRID.linear_conv_dim * 3 * 2  # 2 * 32 + 32 channels x (K - 1) x bf16
    recurrent = 4 * 16 * 8 * 4  # Hv x Dk x Dv fp32
    assert HYBRID.linear_conv_dim == 96 and per == 3 * (conv + recurrent)
    pool = StatePool.for_config(HYBRID, 5, torch.bfloat16)
    assert pool.nbytes == 5 * per and pool.conv.dtype == torch.bfloat16 and pool.recurrent.dtype == torch.float32
    conv_state, rec = pool.layer(2)
    assert conv_state.shape == (5, 96, 3) and rec.shape == (5, 4, 16, 8)
    with pytest.raises(KeyError):
        pool.layer(3)  # the attention layer keeps KV, not a state
    need, why = plan_state(HYBRID, torch.bfloat16, 5, 10 * per)
    assert need == 5 * per and "5 slots" in why
    with pytest.raises(ValueError, match="--max-batch 5"):
        plan_state(HYBRID, torch.bfloat16, 5, 5 * per)
    assert plan_state(ModelConfig(), torch.bfloat16, 5, 1) == (0, "")


def test_the_step_lists_each_chunks_slot_in_the_batchs_order():
    chunks = [SeqChunk(9, 1, [0, 1, 2], state_slot=3), SeqChunk(0, 5, [4, 5], state_slot=1),
              SeqChunk(0, 1, [6], state_slot=0), SeqChunk(4, 3, [7, 8], state_slot=2)]
    batch = ForwardBatch.build([(c, [7] * c.num_tokens) for c in chunks], 4)
    states = batch.states
    assert states.decode_slots.tolist() == [3, 0]  # the one-token chunks, as `batch.decode.rows`
    assert batch.decode.rows.tolist() == [0, 6]
    assert states.prefill_slots == (1, 2) and states.prefills.tolist() == [[1, 5, 1], [7, 3, 2]]
    assert [(p.row_start, p.num_tokens) for p in batch.prefills] == [(1, 5), (7, 3)]
    assert states.fresh.tolist() == [1, 0]  # sequences starting now: their slots are cleared first
    assert ForwardBatch.build([(SeqChunk(0, 2, [0]), [1, 2])], 4).states is None
    with pytest.raises(ValueError, match="state_slot"):
        StateBatch.build([SeqChunk(0, 1, [0], state_slot=1), SeqChunk(0, 1, [1])])


def test_the_cpu_default_budget_adds_the_state_so_the_kv_still_holds_the_full_context():
    """Guards `kv_budget`'s `state_per_sequence` (workers/kv/sizing.py) and its use by the worker
    (workers/engine/kv_cache.py `build_kv_cache`): the state comes out of the budget first, so the
    CPU default adds it; an explicit `--kv-cache-bytes` is the whole budget, state included."""
    import types

    from workers.kv.pool import KVPool
    from workers.kv.sizing import kv_budget

    cpu = types.SimpleNamespace(is_real_gpu=False)
    per_token, per_state = KVPool.bytes_per_token(HYBRID, torch.float32), StatePool.bytes_per_sequence(HYBRID,
                                                                                                    torch.float32)
    assert per_token == 2 * 2 * 16 * 4  # the one full layer's K and V
    args = types.SimpleNamespace(kv_cache_bytes=0, max_batch=3, gpu_memory_utilization=None)
    budget, why = kv_budget(args, cpu, per_token, 512, per_state)
    state, _ = plan_state(HYBRID, torch.float32, 3, budget)
    assert budget - state == 3 * 512 * per_token and "linear layers' state" in why
    assert kv_budget(args, cpu, per_token, 512) == (3 * 512 * per_token, "CPU default: 3 sequences x 512 tokens of "
                                                                          "context")  # fmt: skip
    fixed = types.SimpleNamespace(kv_cache_bytes=10**6, max_batch=3, gpu_memory_utilization=None)
    assert kv_budget(fixed, cpu, per_token, 512, per_state)[0] == 10**6
