"""LoRA adapters written by PEFT, served as PEFT computes them: fp32 logits within 1e-4 of PEFT's
model with the adapter (unmerged and merged), identical greedy tokens, each row of a batch mixing
four adapters and the base model with its own output, and prefixes never shared across adapters."""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter, peft_model
from workers.engine.core import Engine
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.lora.adapter import read_adapter
from workers.lora.apply import LoraBatch, install_lora, lora_rows
from workers.lora.pool import LoraPool
from workers.lora.table import LoraTable
from workers.model.loader import load_model
from workers.sampling.params import SamplingParams

pytest.importorskip("peft")

NEW_TOKENS = 12
# name -> (seed, rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "all": (1, 4, 8.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "rs": (2, 8, 4.0, ("q_proj", "v_proj", "down_proj"), True),
    "mlp": (3, 2, 16.0, ("gate_proj", "up_proj"), False),
    "kv": (4, 6, 12.0, ("k_proj", "v_proj", "o_proj"), True),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def served(request, tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_family_checkpoint(request.param, root / "base")
    dirs = {name: make_adapter(base, root / name, seed, r, alpha, targets, rs)
            for name, (seed, r, alpha, targets, rs) in ADAPTERS.items()}
    ours = load_model(base, "float32")
    install_lora(ours.model)  # the adapters in the pool's slots, as a worker serves them (workers/lora/worker.py)
    pool = ours.model.lora_state.delta.pool = LoraPool(ours.model, ours.config, 8, 16, ours.dtype, "cpu")
    table = LoraTable(lambda name, path: read_adapter(name, path, ours.config, ours.model, 16, ours.dtype), 8,
                      lambda adapter, slot: pool.write(slot, adapter))
    for name, path in dirs.items():
        table.register(name, path)
    return base, dirs, ours, table


def _ids(ours) -> torch.Tensor:
    ids = ours.tokenizer.encode("Once upon a time there was a little fox who lived near the river, and every "
                                "morning it went down to the water").ids
    return torch.tensor([ids[:20], ids[3:23]])  # [2, 20]


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_logits_match_peft(served, name):
    base, dirs, ours, table = served
    ids = _ids(ours)
    adapter = table.acquire(name)
    table.release(name)
    assert adapter.rslora == ADAPTERS[name][4]
    with torch.no_grad():
        want = peft_model(base, dirs[name])(ids).logits
        plain = ours.model(ids).float()
        with lora_rows(ours.model, LoraBatch.from_rows([adapter] * ids.numel())):
            got = ours.model(ids).float()
    assert (plain - want).abs().max() > 1e-2, "the adapter changes nothing: the test proves nothing"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with torch.no_grad():  # and PEFT's merged model (B @ A * scale folded into the base weights)
        merged = peft_model(base, dirs[name]).merge_and_unload()(ids).logits
    torch.testing.assert_close(got, merged, atol=1e-4, rtol=0)


def test_rows_of_one_forward_take_each_their_own_adapter(served):
    """Row 0 with adapter `all`, row 1 with the base model, in one forward: each equals its reference."""
    base, dirs, ours, table = served
    ids = _ids(ours)
    adapter = table.acquire("all")
    table.release("all")
    n = ids.shape[1]
    with torch.no_grad():
        want_lora = peft_model(base, dirs["all"])(ids[:1]).logits
        want_base = peft_model(base)(ids[1:]).logits
        with lora_rows(ours.model, LoraBatch.from_rows([adapter] * n + [None] * n)):
            got = ours.model(ids).float()
    torch.testing.assert_close(got[:1], want_lora, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1:], want_base, atol=1e-4, rtol=0)


def _engine(ours, table, prefix=True, budget=2048, max_sequences=8) -> Engine:
    cfg = ours.config
    pool = KVPool.for_config(cfg, 256, 4, ours.dtype)
    config = SchedulerConfig(max_sequences, cfg.context_length, 256, 4, budget, prefix,
                             eos_token_ids=ours.eos_token_ids, cache_root=root_hash(cfg.architecture),
                             rope=ours.model.rope_policy, kv_groups=pool.group_shapes)
    engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=64)
    engine.loras = table
    return engine


def _run(engine, jobs) -> list[list[int]]:
    streams = [engine.submit(p, SamplingParams.create(max_new_tokens=NEW_TOKENS), lora=lora) for p, lora in jobs]
    while engine.step():
        pass
    return [[e.token_id for e in s.events] for s in streams]


def _reference(model, prompt: list[int], eos) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=list(eos),
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_a_batch_mixing_adapters_and_the_base_gives_each_row_peft_greedy_tokens(served):
    base, dirs, ours, table = served
    ids = _ids(ours)[0].tolist()
    jobs = [(ids, "all"), (ids, None), (ids[2:], "rs"), (ids, "mlp"), (ids[:9], "all"), (ids[1:], None),
            (ids[4:], "kv")]
    with torch.no_grad():
        models = {None: peft_model(base), **{n: peft_model(base, d) for n, d in dirs.items()}}
        want = [_reference(models[lora], p, ours.eos_token_ids) for p, lora in jobs]
    assert len({tuple(w) for w in want[:2] + want[3:4]}) == 3, "adapters that agree prove nothing here"
    engine = _engine(ours, table)
    assert _run(engine, jobs) == want
    alone = [_run(_engine(ours, table), [job])[0] for job in jobs[:3]]
    assert alone == want[:3]
    assert all(info.running == 0 for info in table.describe()), "a finished request still holds its adapter"


def test_prefixes_are_never_shared_across_adapters(served):
    """The same prompt under adapter `all`, then under the base, then `all` again on one engine:
    only the third reuses cached blocks. Guards `lora_key` in the sequence's cache root
    (workers/engine/core.py `submit`): without it the base request would read `all`'s K/V."""
    _, _, ours, table = served
    ids = _ids(ours)[0].tolist()
    engine = _engine(ours, table, budget=64, max_sequences=1)
    hits = engine.metrics.prefix_hits
    _run(engine, [(ids, "all")])
    first = hits._value.get()
    base_tokens = _run(engine, [(ids, None)])[0]
    assert hits._value.get() == first, "the base model reused blocks an adapter computed"
    _run(engine, [(ids, "all")])
    assert hits._value.get() > first, "the same adapter's prefix was not reused"
    with torch.no_grad():
        assert base_tokens == _reference(peft_model(served[0]), ids, ours.eos_token_ids)


def test_the_lora_gauge_names_the_adapters_running_and_waiting(served):
    """vLLM's `vllm:lora_requests_info` after a step: the adapter of the running request, the one
    of the request that waits (one sequence at a time), `max_lora` the table's slots."""
    from prometheus_client import generate_latest

    from workers.lora.metrics import LoraGauge

    _, _, ours, table = served
    engine = _engine(ours, table, max_sequences=1)
    engine.metrics.registry.register(LoraGauge(engine))
    ids = _ids(ours)[0].tolist()
    streams = [engine.submit(ids, SamplingParams.create(max_new_tokens=2), lora=name) for name in ("all", "rs")]
    engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    assert 'vllm:lora_requests_info{max_lora="8",running_lora_adapters="all",waiting_lora_adapters="rs"}' in text
    while engine.step():
        pass
    assert all(s.events for s in streams)
