"""The adapter pool (workers/lora/pool.py) and the table's host tier (workers/lora/table.py): steps read
the slots in place, a slot rewritten holds only its new adapter, an evicted adapter comes back from
host memory (not disk) while its host copy is kept, and `/health` and the metrics say so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

from kernels_local.lora_sgmv.lora_sgmv import lora_sgmv_reference
from workers.lora.adapter import LoraAdapter, LoraTarget
from workers.lora.apply import LoraBatch, LoraDelta, add_lora
from workers.lora.metrics import LoraGauge, LoraLoad, describe_loras
from workers.lora.pool import LoraPool
from workers.lora.stack import StackCache
from workers.lora.table import LoraTable

K, Q, KV = 40, 48, 16  # a fused q/k/v of 80 outputs over 40 inputs
PARTS = ((0, Q), (Q, KV), (Q + KV, KV))
QKV, WO = "attn.wqkv", "attn.wo"


def _model():
    attn = nn.Module()
    attn.wqkv, attn.wo = nn.Linear(K, Q + 2 * KV, bias=False), nn.Linear(Q, K, bias=False)
    model = nn.Module()
    model.attn = attn
    config = SimpleNamespace(has_layer_shapes=False, q_size=Q, kv_size=KV, attn_output_gate=False)
    return model, config


def _adapter(name: str, rank: int, parts, seed: int, scale: float = 0.5, wo: bool = True) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    pairs = tuple(LoraTarget(off, size, torch.randn(rank, K, generator=gen), torch.randn(size, rank, generator=gen))
                  for off, size in parts)
    targets = {QKV: pairs}
    if wo:
        targets[WO] = (LoraTarget(0, K, torch.randn(rank, Q, generator=gen), torch.randn(K, rank, generator=gen)),)
    return LoraAdapter(name, Path(f"/adapters/{name}"), rank, rank * scale, False, scale, targets)


def _pool(slots: int = 4, max_rank: int = 32) -> tuple[LoraPool, LoraDelta]:
    model, config = _model()
    delta = LoraDelta()
    delta.pool = LoraPool(model, config, slots, max_rank, torch.float32, "cpu")
    return delta.pool, delta


def _deltas(rows, name=QKV, width=Q + 2 * KV):
    gen = torch.Generator().manual_seed(7)
    x, base = torch.randn(len(rows), K, generator=gen), torch.randn(len(rows), width, generator=gen)
    return x, base


def test_a_step_reads_the_pool_in_place_whatever_the_mix(monkeypatch):
    """Guards `if self.pool is not None and batch.pooled` in `LoraDelta.stacked`: with it removed a new
    mix builds a stack (a copy of its adapters' weights), which this test forbids."""
    pool, delta = _pool()
    a, b, c = (pool.write(s, _adapter(n, r, p, i)) for s, n, r, p, i in
               ((2, "a", 8, (PARTS[0], PARTS[2]), 1), (0, "b", 24, PARTS, 2), (1, "c", 4, (PARTS[1],), 3)))
    stack = pool.stack(QKV)
    assert a.targets[QKV][0].a.untyped_storage().data_ptr() == stack.a.untyped_storage().data_ptr()

    def no_copy(*args, **kwargs):
        raise AssertionError("a step of pooled adapters built a stack")

    monkeypatch.setattr(StackCache, "get", no_copy)
    for mix in ([a, None, b, c], [c, a], [b, b, None]):
        batch = LoraBatch.from_rows(mix)
        got = delta.stacked(QKV, batch, "cpu")
        assert got is not None and got[0] is stack  # the pool itself, not a copy
        assert got[1].loras.tolist() == [ad.slot for ad in batch.adapters]
        x, base = _deltas(mix)
        want, via_pool = base.clone(), base.clone()
        add_lora(QKV, x, want, batch)
        lora_sgmv_reference(x, via_pool, *got)
        torch.testing.assert_close(via_pool, want, rtol=1e-5, atol=1e-5)
    only_qkv = pool.write(3, _adapter("d", 4, PARTS, 4, wo=False))
    assert delta.stacked(WO, LoraBatch.from_rows([only_qkv]), "cpu") is None  # no adapter of the step targets wo


def test_a_slot_rewritten_holds_only_its_new_adapter():
    """Guards the zeroing of the slot in `LoraPool.write`: without it, `c` (rank 4, k only) would add
    what the slot's former adapter left in q, v and ranks 5..32."""
    pool, delta = _pool()
    pool.write(1, _adapter("old", 32, PARTS, 9, scale=3.0))
    c = _adapter("c", 4, (PARTS[1],), 3)
    placed = pool.write(1, c)
    rows = [None, c, c, None]
    x, base = _deltas(rows)
    want, got = base.clone(), base.clone()
    add_lora(QKV, x, want, LoraBatch.from_rows(rows))  # the adapter as read, outside the pool
    lora_sgmv_reference(x, got, *delta.stacked(QKV, LoraBatch.from_rows([None, placed, placed, None]), "cpu"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :Q], base[:, :Q]) and torch.equal(got[:, Q + KV:], base[:, Q + KV:])
    with pytest.raises(ValueError, match=r"slot `4` does not exist. Accepted: 0..3"):
        pool.write(4, c)


def _table(slots: int, host: int):
    pool, _ = _pool(slots)
    reads: list[str] = []
    adapters = {n: _adapter(n, 4, PARTS, i) for i, n in enumerate("abcd")}

    def read(name, path):
        reads.append(name)
        return adapters[name]

    table = LoraTable(read, slots, lambda adapter, slot: pool.write(slot, adapter), host)
    for n in adapters:
        table.register(n, f"/adapters/{n}", load=False)
    return table, reads, pool


def _use(table, name):
    adapter = table.acquire(name)
    table.release(name)
    return adapter


def test_an_evicted_adapter_comes_back_from_host_memory_not_disk():
    """Guards the host-copy branch of `LoraTable.acquire`: without it `a`'s return reads the disk again."""
    table, reads, pool = _table(slots=2, host=4)
    for n in "abc":  # c takes a's slot
        _use(table, n)
    back = _use(table, "a")  # from its host copy, into b's slot (b the least recently used now)
    assert reads == ["a", "b", "c"]
    assert back.slot is not None and back.targets[QKV][0].a.untyped_storage().data_ptr() == \
        pool.stack(QKV).a.untyped_storage().data_ptr()
    s = table.stats()
    assert (s.loads_from_disk, s.loads_from_host, s.device_evictions, s.host_evictions) == (3, 1, 2, 0)
    assert {i.name: (i.loaded, i.on_host) for i in table.describe()} == {
        "a": (True, True), "b": (False, True), "c": (True, True), "d": (False, False)}


def test_host_copies_are_bounded_least_recently_used_first():
    """Guards the bound in `LoraTable._from_disk`: with host copies of 2, `a`'s is gone by its return."""
    table, reads, _ = _table(slots=1, host=2)
    for n in "abca":
        _use(table, n)
    assert reads == ["a", "b", "c", "a"]
    s = table.stats()
    assert (s.on_device, s.on_host, s.loads_from_host, s.host_evictions) == (1, 2, 0, 2)
    _use(table, "c")
    assert table.stats().loads_from_host == 1 and reads[-1] == "a"
    with pytest.raises(ValueError, match=r"`--max-cpu-loras` must be >= `--max-loras` \(2\), got `1`"):
        LoraTable(lambda n, p: None, 2, max_cpu_loras=1)


def test_health_and_metrics_show_the_pool():
    table, _, _ = _table(slots=2, host=4)
    for n in "abca":
        _use(table, n)
    health = describe_loras(table, LoraLoad())
    assert health["pool"] == {"slots": 2, "on_device": 2, "host_slots": 4, "on_host": 3, "loads_from_disk": 3,
                              "loads_from_host": 1, "device_evictions": 2, "host_evictions": 0}
    assert {a["name"]: a["slot"] for a in health["adapters"]}["a"] is not None
    registry = CollectorRegistry()
    registry.register(LoraGauge(SimpleNamespace(loras=table, lora_load=LoraLoad())))
    text = generate_latest(registry).decode()
    assert 'hetserve_worker_lora_loads_total{source="host"} 1.0' in text
    assert 'hetserve_worker_lora_loads_total{source="disk"} 3.0' in text
    assert 'hetserve_worker_lora_evictions_total{tier="device"} 2.0' in text
    assert 'hetserve_worker_lora_adapters{tier="host"} 3.0' in text


def test_an_adapter_without_a_slot_still_gets_a_stack_of_its_own():
    """An adapter read but not placed (the kernel's first check, a table without a pool) is stacked."""
    pool, delta = _pool()
    placed = pool.write(0, _adapter("a", 4, PARTS, 1))
    loose = replace(_adapter("b", 4, PARTS, 2), slot=None)
    batch = LoraBatch.from_rows([placed, loose])
    stack, segments = delta.stacked(QKV, batch, "cpu")
    assert stack is not pool.stack(QKV) and segments.loras.tolist() == [0, 1]


def test_a_pool_that_does_not_fit_is_a_named_error_and_its_slot_stays_free(monkeypatch):
    """A projection's slots that find no device memory: the load fails naming what to lower, and
    the table gives the slot back (the next adapter takes slot 0)."""
    from workers.lora import pool as pool_module
    from workers.lora.adapter import LoraError

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    table, _, pool = _table(slots=2, host=4)
    with monkeypatch.context() as m:
        m.setattr(pool_module.torch, "zeros", no_memory)
        with pytest.raises(LoraError, match=r"no device memory for the 2 slots of `attn.wqkv`.*`--max-loras`"):
            table.acquire("a")
    assert table.acquire("b").slot == 0 and table.stats().on_device == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_spread_over_adapters_take_the_pooled_torch_path(monkeypatch, dtype):
    """Guards the `add_pooled` branch of `LoraDelta.torch_delta`: a step of three adapters with a few
    rows each is computed from the pool in one pass (the per-adapter path is not called) and adds
    what the per-adapter path adds; a step of one adapter keeps the per-adapter path."""
    from workers.lora import apply as apply_module

    model, config = _model()
    delta = LoraDelta()
    pool = delta.pool = LoraPool(model, config, 4, 32, dtype, "cpu")
    read = [_adapter(n, r, p, i) for n, r, p, i in (("a", 8, (PARTS[0], PARTS[2]), 1), ("b", 24, PARTS, 2),
                                                    ("c", 4, (PARTS[1],), 3))]
    read = [replace(a, targets={k: tuple(replace(t, a=t.a.to(dtype), b=t.b.to(dtype)) for t in v)
                                for k, v in a.targets.items()}) for a in read]
    a, b, c = (pool.write(s, ad) for s, ad in zip((3, 0, 2), read, strict=True))
    rows = [a, None, b, c, a, b, None, c]
    x, base = (t.to(dtype) for t in _deltas(rows))
    want = base.clone()
    add_lora(QKV, x, want, LoraBatch.from_rows(rows))
    calls = []
    monkeypatch.setattr(apply_module, "add_lora", lambda *args: calls.append(args))
    got = base.clone()
    delta.torch_delta(QKV, x, got, LoraBatch.from_rows(rows))
    assert calls == []
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))
    assert torch.equal(got[[1, 6]], base[[1, 6]])  # base rows untouched
    delta.torch_delta(QKV, x, base.clone(), LoraBatch.from_rows([a, a, None]))
    assert len(calls) == 1  # one adapter: the per-adapter path, without a gather


def test_an_adapter_registered_while_every_slot_is_in_use_waits_in_host_memory():
    """Guards the `LoraSlotsFull` catch in `LoraTable.register`: a run-time load while both slots run
    requests is read and checked, kept as a host copy, and placed by its first request later."""
    table, reads, _ = _table(slots=2, host=4)
    table.acquire("a"), table.acquire("b")  # both slots in use
    table.unregister("c")
    assert table.register("c", "/adapters/c").slot is None and reads[-1] == "c"
    assert {i.name: (i.loaded, i.on_host) for i in table.describe()}["c"] == (False, True)
    table.release("a")
    assert table.acquire("c").slot is not None and table.stats().loads_from_host == 1


def test_a_cpu_worker_keeps_its_adapters_in_float32_under_a_bfloat16_model(tmp_path):
    """Guards the float32 return of `adapter_dtype` in workers/lora/worker.py (`build_loras` reads the
    adapters and makes the pool in its dtype): a bfloat16 CPU worker's adapters and slots are float32,
    and the delta added to a bfloat16 output is the float32 product rounded once. Without that line
    the slots hold bfloat16 weights (PEFT's float32 file rounded), whose thin matmuls take the CPU's
    slow bfloat16 path, and the delta differs."""
    pytest.importorskip("peft")
    from tests.family_checkpoints import make_family_checkpoint
    from tests.lora_adapters import make_adapter
    from workers.contract import WorkerConfig
    from workers.lora.worker import build_loras
    from workers.model.loader import load_model

    base = make_family_checkpoint("llama", tmp_path / "base")
    path = make_adapter(base, tmp_path / "coder", 3, std=0.3)
    lm = load_model(base, "bfloat16")
    table = build_loras(WorkerConfig(socket="/tmp/unused.sock", lora=f"coder={path}"), lm, "cpu")
    adapter = table.acquire("coder")
    pool = lm.model.lora_state.delta.pool
    assert pool.dtype == torch.float32 and adapter.slot is not None
    name, pairs = next(iter(adapter.targets.items()))
    assert all(t.a.dtype == t.b.dtype == torch.float32 for t in pairs)
    from safetensors.torch import load_file

    a_file = next(v for k, v in load_file(str(path / "adapter_model.safetensors")).items() if "lora_A" in k)
    assert any(torch.equal(t.a, a_file) for ps in adapter.targets.values() for t in ps)  # PEFT's floats, unrounded
    gen = torch.Generator().manual_seed(0)
    width = pool.stack(name).b.shape[1]
    x = torch.randn(3, pairs[0].a.shape[1], generator=gen).to(torch.bfloat16)
    out = torch.randn(3, width, generator=gen).to(torch.bfloat16)
    want = out.clone()
    for t in pairs:
        delta = ((x[[0, 2]].float() @ t.a.T) @ t.b.T) * adapter.scale
        want[[0, 2], t.offset:t.offset + t.size] += delta.to(torch.bfloat16)
    lm.model.lora_state.delta.forward(name, x, out, LoraBatch.from_rows([adapter, None, adapter]))
    assert torch.equal(out, want)
