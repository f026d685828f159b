"""Every family of the registry against transformers, on a tiny checkpoint transformers wrote.

For each case of tests/family_checkpoints.py (each family with its distinguishing options on:
sliding windows shorter than the prompts, soft-caps, q/k norms, partial rotary, LongRoPE past
its original length, dynamic and yarn rotaries, NoPE layers, multipliers, post-norms):
- fp32 logits of the full forward within 1e-4 of transformers' (eager attention);
- greedy tokens, 32 new ones per prompt, identical to transformers' `generate` for each prompt
  alone, through the engine three ways: all prompts batched together; chunked prefill with
  the prefix cache, one request at a time so each finds the last one's blocks; and a KV pool
  too small for all of them, so sequences are preempted and recomputed.
The HTTP path is covered once per family in tests/test_e2e_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import CASES, make_family_checkpoint
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.groups import window_blocks
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
TEXT = ("Once upon a time there was a little fox who lived near the river, and every morning it went "
        "down to the water to look at the fish and the birds and the boats that came and went.")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    torch.set_num_threads(1)
    path = make_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ours = load_model(path, "float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    ref.eval()
    return request.param, ours, ref


def _prompts(ours) -> list[list[int]]:
    """Prompts longer than the sliding window (16), two sharing their first 24 tokens, one short."""
    ids = ours.tokenizer.encode(TEXT).ids
    assert len(ids) >= 44
    return [ids[:41], ids[:24] + ids[30:44], ids[:11], ids[3:36]]


def _reference(ref, prompt: list[int], eos: tuple[int, ...]) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(eos),
                       pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_outputs(ours, prompts, *, num_blocks=256, block_size=4, budget=2048, max_sequences=8, prefix=True):
    cfg = ours.config
    spare = 16 if cfg.state_layers else 0  # a hybrid's snapshots of its state (workers/kv/snapshots.py)
    pool = KVPool.for_config(cfg, num_blocks, block_size, ours.dtype, state_slots=max_sequences + spare)
    slots = max_sequences if pool.states is not None else 0  # linear layers' state (workers/kv/state.py)
    config = SchedulerConfig(max_sequences, cfg.context_length, num_blocks, block_size, budget, prefix,
                             eos_token_ids=ours.eos_token_ids, cache_root=root_hash(cfg.architecture),
                             rope=ours.model.rope_policy, kv_groups=pool.group_shapes, state_slots=slots,
                             state_snapshots=spare)
    engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=64)
    streams = [engine.submit(p, SamplingParams.create(max_new_tokens=NEW_TOKENS)) for p in prompts]
    while engine.step():
        pass
    assert engine.scheduler.kv.usage == 0
    states = engine.scheduler.kv.states
    assert states is None or states.num_free == states.num_slots, "a state slot outlived its sequence"
    return [[e.token_id for e in s.events] for s in streams], engine


def test_logits_match_transformers(case):
    name, ours, ref = case
    prompts = _prompts(ours)
    ids = torch.tensor([prompts[0][:40], prompts[3][:33] + prompts[0][:7]])  # [2, 40]
    with torch.no_grad():
        want = ref(ids).logits
        got = ours.model(ids).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_logits_match_transformers_as_a_cpu_worker_runs_the_model(case):
    """The same parity through the layers a CPU worker installs: kernelized for the CPU, every
    projection and expert stack multiplied through its oneDNN pack (workers/model/cpu_projections.py,
    all sizes packed here), the rows padded to buckets (40 rows -> 48)."""
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.cpu_projections import install_cpu_projections

    name, ours, ref = case
    worker = load_model(ours.model_dir, "float32")
    kernelize_for_device(worker.model, BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False))
    assert install_cpu_projections(worker.model, "cpu", worker.dtype, min_elements=0).packed > 0
    prompts = _prompts(ours)
    ids = torch.tensor([prompts[0][:40], prompts[3][:33] + prompts[0][:7]])  # [2, 40]
    with torch.no_grad():
        want = ref(ids).logits
        got = worker.model(ids).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")


def test_the_weight_map_gives_back_the_checkpoints_tensors(case):
    """Every family's one map, inverted (`to_hf`): our state dict split, unstacked and turned back
    into the checkpoint's layouts (gpt-oss's interleaved, transposed experts) equals every tensor
    transformers wrote, bit for bit."""
    from safetensors.torch import load_file

    from workers.model.weights import to_hf

    name, ours, _ = case
    written = load_file(str(ours.model_dir / "model.safetensors"))
    back = to_hf(ours.model)
    if ours.config.tie_word_embeddings:
        written.pop("lm_head.weight", None)
    assert set(back) == set(written), name
    for key, tensor in written.items():
        assert torch.equal(back[key], tensor), f"{name}: {key}"


def test_greedy_tokens_match_transformers_batched_chunked_cached_and_preempted(case):
    name, ours, ref = case
    prompts = _prompts(ours)
    with torch.no_grad():
        want = [_reference(ref, p, ours.eos_token_ids) for p in prompts]
    batched, _ = _engine_outputs(ours, prompts)
    assert batched == want, name
    chunked, engine = _engine_outputs(ours, prompts, budget=8, max_sequences=1)  # one at a time: prefix hits
    assert chunked == want, name
    hits = engine.metrics.prefix_hits._value.get()  # a hybrid's too: its prompt chunks' ends keep snapshots
    assert hits >= 20, f"{name}: the shared prefix was not reused ({hits} tokens)"
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    windows = ours.config.layer_windows
    # a sequence holds all of its blocks where some layer attends fully, else about one window
    tight_blocks = -(-longest // 4) + 3 if None in windows else window_blocks(min(windows), 4) + 5
    tight, engine = _engine_outputs(ours, prompts, num_blocks=tight_blocks, budget=16)
    assert tight == want, name
    assert engine.scheduler.num_preemptions > 0, f"{name}: the pool was large enough that nothing was preempted"


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_sliding_layers_hold_a_window_of_blocks_as_a_sequence_grows(name, tmp_path):
    """One sequence generating far past the window (16): the full group's blocks grow with it,
    the sliding group's stay within one window of blocks at every step (guards the scheduler's
    `self.kv.slide(seq)` after each step: without it they grow like the full group's). Gemma 3
    has both groups; Mistral slides in every layer, so its only group stays bounded."""
    ours = load_model(make_family_checkpoint(name, tmp_path), "float32")
    windows, bs, new = ours.config.layer_windows, 4, 120
    pool = KVPool.for_config(ours.config, 64, bs, ours.dtype)
    config = SchedulerConfig(1, ours.config.context_length, 64, bs, 8, True, eos_token_ids=(),
                             cache_root=root_hash(name), kv_groups=pool.group_shapes)
    engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=4)
    stream = engine.submit(ours.tokenizer.encode(TEXT).ids[:20], SamplingParams.create(max_new_tokens=new))
    held = []
    while engine.step():
        held.append(engine.scheduler.kv.blocks_in_use())
    assert len(stream.events) == new
    bound = window_blocks(min(w for w in windows if w is not None), bs) + -(-8 // bs)  # a window + a chunk
    for g, (window, _) in enumerate(pool.group_shapes):
        most = max(h[g] for h in held)
        if window is None:
            assert most == -(-(20 + new - 1) // bs), "the full group holds every position"
        else:
            assert most <= bound, f"sliding group {g} held {most} blocks (bound {bound})"
