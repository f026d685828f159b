"""The host KV tier through the real engine on the embedded model (workers/kvtier/, the block
manager's hooks in workers/kv/manager.py): the same greedy tokens with and without it, fewer
prefill tokens computed once the device pool has evicted a conversation's prefix, a second
engine continuing another's conversation, and a different KV format sharing nothing."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import default_model_dir
from tests.prefill_count import count_prefill
from workers.engine.core import Engine
from workers.engine.events import ErrorEvent
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.kvtier.tier import HostTier
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

BLOCK, BLOCKS = 8, 12  # 96 token positions: one conversation's longest turn fits, three do not
NEW = 8
TOPICS = ["The history of the river valley and the towns along its banks, told from the first settlers",
          "A recipe for bread: flour, water, salt and yeast, mixed and left to rise overnight in a warm room",
          "Notes on the weather this spring: rain in the mornings, sun after noon, and cold clear nights"]


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_dir(), "float32")


class Counted:
    """An engine whose steps' computed prefill tokens are summed (`prefill`)."""

    def __init__(self, lm, tier_dir=None, block=BLOCK, dtype=torch.float32, budget=64 << 20):
        pool = KVPool.for_config(lm.config, BLOCKS * BLOCK // block, block, dtype, "cpu")
        root = root_hash(lm.model_id, dtype, "none", block)
        config = SchedulerConfig(2, lm.config.context_length, pool.num_blocks, block, 2048, True, cache_root=root)
        self.engine = Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=8)
        self.tier = HostTier.open(pool, root, tier_dir, budget) if tier_dir is not None else None
        if self.tier is not None:
            assert self.tier.enabled, self.tier.reason
            self.engine.attach_tier(self.tier)
        count_prefill(self)

    def generate(self, ids: list[int]) -> list[int]:
        stream = self.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW))
        while self.engine.step():
            pass
        if self.tier is not None:
            self.tier.flush()
        return [e.token_id for e in stream.events]


def conversations(lm, engine: Counted, turns: int = 3) -> tuple[list[list[int]], list[int]]:
    """Three conversations taking turns (each turn evicts the others' prefixes from the device
    pool); every turn's output, and the prefill tokens computed in each round of turns."""
    history = [lm.tokenizer.encode(t).ids for t in TOPICS]
    outputs, per_round = [], []
    for turn in range(turns):
        before = engine.prefill
        for c in range(len(history)):
            out = engine.generate(history[c])
            outputs.append(out)
            history[c] = history[c] + out + lm.tokenizer.encode(f" and then, turn {turn}:").ids
        per_round.append(engine.prefill - before)
    return outputs, per_round


def test_the_tier_gives_the_same_greedy_tokens_and_computes_fewer_prefill_tokens(lm, tmp_path):
    """Guards `admit`'s host hits (workers/kv/manager.py `_host_hits`): without them the later
    rounds recompute every evicted prefix."""
    plain, plain_rounds = conversations(lm, Counted(lm))
    tiered_engine = Counted(lm, tmp_path)
    tiered, tier_rounds = conversations(lm, tiered_engine)
    assert tiered == plain
    assert plain_rounds[0] == tier_rounds[0], "the first round has nothing to reuse"
    assert sum(tier_rounds[1:]) * 3 < sum(plain_rounds[1:]), (plain_rounds, tier_rounds)
    d = tiered_engine.tier.describe()
    assert d["hits"] > 0 and d["blocks_loaded"] > 0 and d["blocks_written"] > 0
    assert tiered_engine.engine.kv_now()["kv_host_tier"]["blocks_loaded"] == d["blocks_loaded"]


def test_a_second_engine_continues_anothers_conversation_from_the_tier(lm, tmp_path):
    """A second worker of the same model and KV format reads the first's blocks: its turn computes
    only what the first never computed, with the tokens a worker without the tier gives."""
    first, second, alone = Counted(lm, tmp_path), Counted(lm, tmp_path), Counted(lm)
    ids = lm.tokenizer.encode(TOPICS[0] + " " + TOPICS[1]).ids
    out = first.generate(ids)
    turn = ids + out + lm.tokenizer.encode(" and so the story goes on").ids
    assert second.generate(turn) == alone.generate(turn)
    assert alone.prefill == len(turn)
    full = (len(ids) + len(out)) // BLOCK * BLOCK  # blocks the first worker filled (its last token never computed)
    assert second.prefill <= len(turn) - (len(ids) - 1) // BLOCK * BLOCK
    assert second.prefill < len(turn) // 2, (second.prefill, len(turn), full)
    assert second.tier.describe()["blocks_loaded"] >= len(ids) // BLOCK - 1


@pytest.mark.parametrize("other", ["block size", "dtype"])
def test_a_different_kv_format_shares_nothing(lm, tmp_path, other):
    """A worker whose KV format differs (block size or dtype) reads none of the first's blocks."""
    first = Counted(lm, tmp_path)
    ids = lm.tokenizer.encode(TOPICS[2]).ids
    first.generate(ids)
    kw = {"block": 4} if other == "block size" else {"dtype": torch.bfloat16}
    second = Counted(lm, tmp_path, **kw)
    second.generate(ids)
    assert second.prefill == len(ids)
    d = second.tier.describe()
    assert d["hits"] == 0 and d["blocks_loaded"] == 0 and d["blocks_refused"] == 0
    assert d["format_key"] != first.tier.describe()["format_key"]


def test_a_pool_the_tier_cannot_serve_says_why(lm, tmp_path):
    """A hybrid without a prefix cache gets the reason about its state (`hybrid_reason`,
    workers/kvtier/format.py), with the bytes one snapshot would take; with the cache (so with
    snapshots) it gets a tier whose key covers the state's shapes, apart from the same attention
    layers' dense format. Guards the `pool.states is not None and not prefix_caching` line and the
    state's place in `KVFormat.key`."""
    from workers.kv.state import StatePool

    pool = KVPool.for_config(lm.config, 8, BLOCK, torch.float32, "cpu")
    tier = HostTier.open(pool, b"r", tmp_path, 1 << 20, prefix_caching=False)
    assert not tier.enabled and "--no-prefix-cache" in tier.reason
    dense = HostTier.open(pool, b"r", tmp_path, 1 << 20).format
    pool.states = StatePool((1, 3), 2, 8, 4, 2, 4, 4)  # conv 8 x 3 and recurrent 2 x 4 x 4 fp32, two layers
    hybrid = HostTier.open(pool, b"r", tmp_path, 1 << 20, prefix_caching=False)
    assert not hybrid.enabled and "linear-attention state" in hybrid.reason, hybrid.reason
    assert "one snapshot is 448 bytes" in hybrid.reason and "not snapshotted" in hybrid.reason
    assert hybrid.describe()["reason"] == hybrid.reason
    served = HostTier.open(pool, b"r", tmp_path, 1 << 20)
    assert served.enabled and served.format.state_bytes == 448 and served.format.key != dense.key
    assert HostTier.open(pool, b"r", None, 1 << 20).describe() == {
        "enabled": False, "reason": "no tier directory (the router makes one; `--kv-host-dir`)"}


def test_a_corrupted_tier_block_is_refused_and_its_tokens_recomputed_alike(lm, tmp_path):
    """Guards the store's checksum on the engine's path: a flipped byte in a block another worker
    wrote is refused (and deleted); the chain stops there and the rest is recomputed, giving the
    same tokens as a worker without the tier."""
    first = Counted(lm, tmp_path)
    ids = lm.tokenizer.encode(TOPICS[0] + " " + TOPICS[2]).ids
    first.generate(ids)
    files = sorted(first.tier.store.dir.glob("*.kvb"), key=lambda p: p.stat().st_mtime)
    assert len(files) >= 3
    victim = files[1]  # the second block written: the second block of the chain
    raw = bytearray(victim.read_bytes())
    raw[-5] ^= 0x40
    victim.write_bytes(bytes(raw))
    second, alone = Counted(lm, tmp_path), Counted(lm)
    assert second.generate(ids) == alone.generate(ids)
    d = second.tier.describe()
    assert d["blocks_refused"] == 1 and "checksum" in d["last_refused"]
    assert victim.read_bytes() != bytes(raw), "deleted, recomputed and written through again"
    assert d["blocks_loaded"] == 1, "only the block before the refused one"
    assert second.prefill == len(ids) - BLOCK


def test_checkpoints_sharing_a_name_or_other_numerics_get_other_keys(lm, tmp_path):
    """Guards `model_fingerprint` and the numerics in `HostTier.for_worker`'s key: two checkpoints
    both called `model` (the same `model_id`, the same shapes) never share blocks, nor do a
    `--deterministic` worker and a default one."""
    from workers.contract import WorkerConfig

    pool = KVPool.for_config(lm.config, 8, BLOCK, torch.float32, "cpu")
    dirs = []
    for name, size in (("a", 10), ("b", 11)):
        d = tmp_path / name / "model"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * size)
        dirs.append(d)
    config = WorkerConfig(socket="s", kv_host_dir=str(tmp_path / "tier"), kv_host_bytes=1 << 20)

    def key(model_dir, cfg=config):
        tier = HostTier.for_worker(cfg, pool, b"root", True, model_dir)
        assert tier.enabled, tier.reason
        return tier.describe()["format_key"]

    assert key(dirs[0]) == key(dirs[0])
    assert key(dirs[0]) != key(dirs[1])
    assert key(dirs[0]) != key(dirs[0], WorkerConfig(socket="s", kv_host_dir=config.kv_host_dir,
                                                     kv_host_bytes=1 << 20, deterministic=True))


def run_together(engine: Counted, prompts: list[list[int]], new: int) -> list[list[int]]:
    streams = [engine.engine.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True)) for ids in prompts]
    while engine.engine.step():
        pass
    return [[e.token_id for e in s.events] for s in streams]


def test_a_preempted_sequence_is_swapped_to_the_tier_and_resumed_without_recompute(lm, tmp_path):
    """Guards the scheduler's `swap_out` before a preemption's `free`: two sequences outgrow the
    device pool together, the newer one is preempted, and it resumes from the tier with every
    computed token (the last, partly filled block too) instead of recomputing them."""
    ids = lm.tokenizer.encode(" ".join(TOPICS)).ids
    prompts = [ids[:30], ids[30:58]]  # the older one needs a block while the newer's last is part full
    new = 40  # 30 + 40 and 28 + 40 positions > the pool's 96
    alone = Counted(lm)
    reference = [run_together(alone, [p], new)[0] for p in prompts]
    plain, tiered = Counted(lm), Counted(lm, tmp_path)
    assert run_together(plain, prompts, new) == reference
    assert run_together(tiered, prompts, new) == reference
    for side in (plain, tiered):
        assert side.engine.scheduler.num_preemptions > 0
    assert plain.engine.scheduler.num_recomputed_tokens > 0, "without the tier the resume recomputes"
    s = tiered.engine.scheduler
    assert s.num_swapped_out == s.num_preemptions
    assert s.num_recomputed_tokens == 0, "every token it had computed came back from the device or the tier"
    assert tiered.tier.describe()["partial_blocks_loaded"] > 0


def test_a_stream_ended_by_a_shutdown_moves_with_its_kv_and_its_resume_computes_nothing(lm, tmp_path):
    """Guards `publish_kv` in `Engine._abort_all` (workers/engine/core.py): when a shutdown ends a
    running stream (which the router then moves), every token it computed, the partly filled last
    block too, is already written to the tier when the error is sent; the worker that continues
    it (`resume_ids`) loads them all, computes no prompt token again, and goes on with the tokens
    of an undisturbed run."""
    ids = lm.tokenizer.encode(TOPICS[1]).ids
    new = 28
    reference = run_together(Counted(lm), [ids], new)[0]
    first, second = Counted(lm, tmp_path), Counted(lm, tmp_path)
    stream = first.engine.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True))
    for _ in range(11):  # the prompt, then ten decodes: 11 tokens sent, the last one not computed yet
        first.engine.step()
    events, written_at_error = [], []  # `redirect` hands the events so far to the sink first

    def sink(_stream, event):  # on the engine thread, as the channel's sink is
        events.append(event)
        if isinstance(event, ErrorEvent):
            written_at_error.append(len(list(first.tier.store.dir.glob("*.kvb"))))

    stream.redirect(sink)
    first.engine.start()
    first.engine.shutdown(0.0)
    error = events[-1]
    assert isinstance(error, ErrorEvent), error
    sent = [e.token_id for e in events[:-1]]
    assert 11 <= len(sent) < new and sent == reference[: len(sent)]
    computed = len(ids) + len(sent) - 1
    assert error.message.endswith(f"(its KV cache, {computed} tokens, is in the host KV tier)"), error.message
    blocks, partial = -(-computed // BLOCK), int(computed % BLOCK > 0)  # the last one partly filled, or not
    assert written_at_error == [blocks], "every full block and the partial one, before the error"
    resumed = second.engine.submit(ids, SamplingParams.create(max_new_tokens=new, ignore_eos=True), resume_ids=sent)
    while second.engine.step():
        pass
    assert sent + [e.token_id for e in resumed.events] == reference
    assert second.prefill == 0, "the resume computes only its next decode token"
    d = second.tier.describe()
    assert d["blocks_loaded"] == blocks and d["partial_blocks_loaded"] == partial, d


@pytest.mark.gpu
def test_on_a_gpu_blocks_go_out_on_the_tiers_copy_stream_and_are_never_read_half_copied(lm, tmp_path):
    """Guards `HostTier._copy_out` and the fence in `write_behind` (workers/kvtier/tier.py): a
    block copied out on the copy stream into pinned memory is stored with the values it held when
    it was cached, although the compute stream rewrites it right after the next `write_behind`;
    a lookup served from the writer's queue reads the same values, and loading them back into
    another device block gives that block exactly."""
    pool = KVPool.for_config(lm.config, 8, BLOCK, torch.float32, "cuda")
    tier = HostTier.open(pool, b"root", tmp_path, 64 << 20)
    assert tier.enabled and tier._copy_stream is not None, tier.reason
    kv = pool.tensors[0]  # [L, 2, Hkv, blocks, B, D]
    original = torch.randn_like(kv[:, :, :, 1])
    kv[:, :, :, 1].copy_(original)
    tier.cached(1, b"h" * 32)
    queued = tier.writer.peek(b"h" * 32)
    assert isinstance(queued, tuple) and queued[0].obj is not None, "a pinned buffer and its event"
    tier.write_behind()
    kv[:, :, :, 1].fill_(7.0)  # the next step reuses the block, on the compute stream
    host, held = tier.fetch([b"h" * 32])
    assert held == [] and len(host) == 1
    tier.load([2], host)
    torch.testing.assert_close(kv[:, :, :, 2], original, rtol=0, atol=0)
    tier.flush()
    stored = torch.frombuffer(bytearray(tier.store.get(b"h" * 32)), dtype=torch.float32)
    torch.testing.assert_close(stored.view_as(original), original.cpu(), rtol=0, atol=0)
    tier.close()


@pytest.mark.gpu
def test_on_a_gpu_a_state_snapshot_goes_out_on_the_copy_stream_and_comes_back_exactly(tmp_path):
    """Guards the GPU branch of `HostTier.put_state`: a hybrid's snapshot copied on the tier's stream
    into pinned memory holds the slot's values although the compute stream overwrites the slot
    right after, and `load_state` puts them back into another slot exactly."""
    from workers.kv.state import StatePool

    pool = KVPool.for_config(load_model(default_model_dir(), "float32").config, 8, BLOCK, torch.float32, "cuda")
    pool.states = StatePool((1, 3), 3, 8, 4, 2, 4, 4, device="cuda")
    tier = HostTier.open(pool, b"root", tmp_path, 64 << 20)
    assert tier.enabled and tier._copy_stream is not None, tier.reason
    pool.states.recurrent[:, 1].copy_(torch.randn_like(pool.states.recurrent[:, 1]))
    pool.states.conv[:, 1].copy_(torch.randn_like(pool.states.conv[:, 1]))
    want = (pool.states.recurrent[:, 1].clone(), pool.states.conv[:, 1].clone())
    tier.put_state(b"s" * 32, 1)
    pool.states.recurrent[:, 1].fill_(7.0)  # the slot reused on the compute stream
    pool.states.conv[:, 1].fill_(7.0)
    payload = tier.fetch_state(b"s" * 32)
    tier.load_state(payload, 2)
    torch.testing.assert_close(pool.states.recurrent[:, 2], want[0], rtol=0, atol=0)
    torch.testing.assert_close(pool.states.conv[:, 2], want[1], rtol=0, atol=0)
    tier.close()
