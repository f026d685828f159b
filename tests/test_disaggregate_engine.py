"""A prefill for another worker through the real engine on the embedded model (`publish_kv`,
workers/engine/core.py and scheduler.py): the engine stops after the first token and its prompt's
blocks, the partly filled last one too, are in the host tier before that token is delivered, so a
second engine continuing with it as `resume_ids` computes one token of prefill and gives the
tokens one engine alone gives."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import default_model_dir
from tests.prefill_count import count_prefill
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.hashing import block_hash, root_hash
from workers.kv.pool import KVPool
from workers.kvtier.foreign import ForeignReader, foreign_formats
from workers.kvtier.tier import HostTier
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

BLOCK, BLOCKS, NEW = 8, 16, 6
PROMPT = ("The history of the river valley and the towns along its banks, told from the first settlers who "
          "came with their cattle")


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_dir(), "float32")


class Worker:
    """One engine (its own pool) over the tier in `tier_dir`; `prefill` sums its prompt tokens computed."""

    def __init__(self, lm, tier_dir=None, dtype=torch.float32, foreign: bool = False):
        pool = KVPool.for_config(lm.config, BLOCKS, BLOCK, dtype, "cpu")
        root = root_hash(lm.model_id, dtype, "none", BLOCK)
        config = SchedulerConfig(2, lm.config.context_length, pool.num_blocks, BLOCK, 2048, True, cache_root=root)
        self.engine = Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=8)
        self.tier = HostTier.open(pool, root, tier_dir, 64 << 20) if tier_dir is not None else None
        if self.tier is not None:
            self.engine.attach_tier(self.tier)
        if foreign:  # as `HostTier.for_worker` makes it (the identity here is the chain root itself)
            formats = foreign_formats(self.tier.format, dtype, tier_dir,
                                      lambda d: root_hash(lm.model_id, d, "none", BLOCK), lambda r: r)
            self.tier.foreign = ForeignReader(self.tier.format, dtype, formats)
        count_prefill(self)

    def run(self, ids: list[int], **kw) -> list:
        stream = self.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), **kw)
        while self.engine.step():
            pass
        return stream.events


@pytest.mark.parametrize("extra", [0, 3], ids=["last block full", "last block partly filled"])
def test_a_published_prefill_stops_at_one_token_and_the_next_engine_reads_its_prompt(lm, tmp_path, extra):
    """Guards the flush in `Engine._end_step` (the writer is only woken by the next step, so the
    second engine would find nothing) and `or seq.publish_kv` in `Scheduler.append_token`."""
    ids = lm.tokenizer.encode(PROMPT).ids
    ids = ids[: (len(ids) // BLOCK - 1) * BLOCK + extra]
    alone = [e.token_id for e in Worker(lm).run(ids)]
    prefill, decode = Worker(lm, tmp_path), Worker(lm, tmp_path)
    stream = prefill.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), publish_kv=True)
    prefill.engine.step()  # one step: the next would wake the tier's writer anyway
    events = stream.events
    assert [e.token_id for e in events] == alone[:1]
    assert events[-1].finish is not None and events[-1].finish.reason == "length"
    rest = decode.run(ids, resume_ids=[alone[0]])
    assert [e.token_id for e in rest] == alone[1:]
    assert decode.prefill <= 1, "the prompt's blocks came from the tier; at most the first token is computed"
    assert decode.tier.describe()["blocks_loaded"] == -(-len(ids) // BLOCK)


@pytest.fixture(scope="module")
def halves(lm):
    return load_model(default_model_dir(), "bfloat16"), load_model(default_model_dir(), "float16")


def _prefilled_in_bf16(bf16, tmp_path) -> tuple[list[int], int]:
    ids = bf16.tokenizer.encode(PROMPT).ids
    prefill = Worker(bf16, tmp_path, torch.bfloat16)
    stream = prefill.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), publish_kv=True)
    prefill.engine.step()
    return ids, stream.events[0].token_id


def test_an_fp16_worker_reads_a_bf16_workers_blocks_where_the_cast_is_exact(halves, tmp_path):
    """Guards `fetch_foreign` in `KVCacheManager._host_hits`: without it the fp16 worker finds nothing."""
    bf16, fp16 = halves
    ids, first = _prefilled_in_bf16(bf16, tmp_path)
    decode = Worker(fp16, tmp_path, torch.float16, foreign=True)
    rest = decode.run(ids, resume_ids=[first])
    assert len(rest) == NEW - 1
    foreign = decode.tier.describe()["foreign"]
    assert foreign["formats"] == ["bfloat16", "float32"]
    assert foreign["blocks_converted"] + foreign["casts_refused"] >= 1
    if foreign["casts_refused"] == 0:  # every block fit fp16 exactly: nothing recomputed
        assert foreign["blocks_converted"] == -(-len(ids) // BLOCK) and decode.prefill <= 1
    else:  # a block holding a value fp16 cannot hold exactly (a tiny one, most often): read up to it
        assert decode.prefill == len(ids) + 1 - foreign["blocks_converted"] * BLOCK
        assert foreign["last_refusal"].startswith("bfloat16 -> float16")


def test_a_bf16_block_out_of_fp16_range_is_recomputed_with_the_reason(halves, tmp_path):
    """Guards the refusal in `ForeignReader._converted`: a value beyond 65504 is never rounded in."""
    bf16, fp16 = halves
    ids, first = _prefilled_in_bf16(bf16, tmp_path)
    store = Worker(bf16, tmp_path, torch.bfloat16).tier.store
    h = block_hash(root_hash(bf16.model_id, torch.bfloat16, "none", BLOCK), ids[:BLOCK])
    block = torch.frombuffer(bytearray(store.get(h)), dtype=torch.bfloat16)
    block[0] = 1e6
    assert store.put(h, memoryview(block.view(torch.uint8).numpy()), replace=True)
    decode = Worker(fp16, tmp_path, torch.float16, foreign=True)
    rest = [e.token_id for e in decode.run(ids, resume_ids=[first])]
    alone = [e.token_id for e in Worker(fp16).run(ids, resume_ids=[first])]
    assert rest == alone
    foreign = decode.tier.describe()["foreign"]
    assert foreign["casts_refused"] == 1 and foreign["blocks_converted"] == 0
    assert "65504" in foreign["last_refusal"] and decode.prefill == len(ids) + 1


def test_a_prompt_prefilled_in_part_elsewhere_at_every_block_boundary_gives_one_engines_tokens(lm, tmp_path):
    """A split prefill (server/routing/split.py PART): one engine publishes the prompt's first k
    tokens (as a request of its own, one token sampled and dropped), another runs the whole
    request, reads those k from the tier and computes only the rest, for every whole-block k."""
    ids = lm.tokenizer.encode(PROMPT).ids
    alone = [e.token_id for e in Worker(lm).run(ids)]
    for k in range(BLOCK, len(ids), BLOCK):
        tier = tmp_path / f"k{k}"
        part, rest = Worker(lm, tier), Worker(lm, tier)
        stream = part.engine.submit(ids[:k], SamplingParams.create(max_new_tokens=1), publish_kv=True)
        part.engine.step()
        assert stream.events[-1].finish is not None
        assert [e.token_id for e in rest.run(ids)] == alone, k
        assert rest.prefill == len(ids) - k, k  # the part came from the tier, not computed again


def test_an_moe_models_prompt_published_whole_or_in_part_continues_as_one_engine(tmp_path):
    """The same two handoffs on a Qwen3-MoE (experts routed per token): the whole prompt and its
    first token on one engine, or its first two blocks, then the other engine gives one engine's
    tokens and computes only what the tier did not hold."""
    from tests.family_checkpoints import make_family_checkpoint

    moe = load_model(make_family_checkpoint("qwen3_moe", tmp_path / "moe"), "float32")
    ids = moe.tokenizer.encode(PROMPT).ids
    alone = [e.token_id for e in Worker(moe).run(ids)]
    prefill, decode = Worker(moe, tmp_path / "whole"), Worker(moe, tmp_path / "whole")
    stream = prefill.engine.submit(ids, SamplingParams.create(max_new_tokens=NEW), publish_kv=True)
    prefill.engine.step()
    assert [e.token_id for e in stream.events] == alone[:1]
    assert [e.token_id for e in decode.run(ids, resume_ids=[alone[0]])] == alone[1:] and decode.prefill <= 1
    part, rest = Worker(moe, tmp_path / "part"), Worker(moe, tmp_path / "part")
    part.engine.submit(ids[:2 * BLOCK], SamplingParams.create(max_new_tokens=1), publish_kv=True)
    part.engine.step()
    assert [e.token_id for e in rest.run(ids)] == alone and rest.prefill == len(ids) - 2 * BLOCK
