"""The segmented LoRA kernel (kernels_local/lora_sgmv/) against the torch path (workers/lora/apply.py
`add_lora`, the reference PEFT parity is proven on).

What must hold:
- on batches that mix adapters of different ranks and targets with base-only rows, prefill segments
  (SGMV tiles) and decode rows (BGMV, one row per program), the kernel under `TRITON_INTERPRET=1`
  (this file reruns itself in a child with it) adds exactly the torch path's delta in fp32 and
  within rounding in bf16 / fp16, for each tuning, and leaves base-only rows bit for bit;
- the repository's own torch reference equals the worker's torch path;
- the kernel reads the worker's pool of slots in place (workers/lora/pool.py), adapters in any slots,
  as it reads a stack of the step's adapters;
- a kernel layer called as the worker calls it (`LoraDelta.forward(name, x, out, batch)`) launches on
  the worker's stacks, and a projection no adapter targets is left alone;
- the launches the wrapper makes are among the declared `COMPILE_SPECS`, and those compile ahead of
  time for the architectures each tuning is for.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels_local.compile_spec import Workload
from kernels_local.lora_sgmv import TUNINGS, layers, lora_sgmv, lora_sgmv_reference
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from tests.preflight_checks import assert_recorded_launches
from workers.lora.adapter import LoraAdapter, LoraTarget
from workers.lora.apply import LoraBatch, LoraDelta, add_lora
from workers.lora.pool import LoraPool
from workers.lora.stack import build_stack

SGMV = importlib.import_module("kernels_local.lora_sgmv.lora_sgmv")
ARCHS = {"LoraDeltaTritonSm70": ("sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89"),
         "LoraDeltaTritonSm90": ("sm_90", "sm_100", "sm_103", "sm_120"),
         "LoraDeltaTritonRocm": ("gfx90a", "gfx942", "gfx950")}
K, PARTS = 40, ((0, 48), (48, 16), (64, 16))  # a fused q/k/v of 80 outputs over 40 inputs (no tile fills)


def _adapter(name: str, rank: int, parts, seed: int, dtype=torch.float32, scale: float = 0.5) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    pairs = tuple(LoraTarget(off, size, torch.randn(rank, K, generator=gen).to(dtype),
                             torch.randn(size, rank, generator=gen).to(dtype)) for off, size in parts)
    return LoraAdapter(name, None, rank, rank * scale, False, scale, {"wqkv": pairs, "wo": pairs[:1]})


def _mixed(dtype=torch.float32, prefill: int = 20):
    """Rows: a prefill chunk of adapter a (rank 8, q and v), decode rows of b (rank 24, q/k/v) and c
    (rank 4, k only) interleaved with base rows; returns (adapters per row, adapters)."""
    a = _adapter("a", 8, (PARTS[0], PARTS[2]), 1, dtype)
    b = _adapter("b", 24, PARTS, 2, dtype, scale=2.0)
    c = _adapter("c", 4, (PARTS[1],), 3, dtype, scale=1 / 3)
    rows = [None, *([a] * prefill), b, None, c, b, None, c, None]
    return rows, (a, b, c)


def _run_both(rows, dtype, tuning, name="wqkv"):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(rows), K, generator=gen).to(dtype)
    base = torch.randn(len(rows), 80, generator=gen).to(dtype)
    batch = LoraBatch.from_rows(rows)
    want, got = base.clone(), base.clone()
    add_lora(name, x, want, batch)
    stack = build_stack(batch.adapters, name, "cpu")
    lora_sgmv(x, got, stack, batch.segments, tuning=tuning)
    return base, want, got


def test_the_repositorys_reference_is_the_workers_torch_path():
    rows, _ = _mixed()
    batch = LoraBatch.from_rows(rows)
    gen = torch.Generator().manual_seed(0)
    x, base = torch.randn(len(rows), K, generator=gen), torch.randn(len(rows), 80, generator=gen)
    want, got = base.clone(), base.clone()
    add_lora("wqkv", x, want, batch)
    lora_sgmv_reference(x, got, build_stack(batch.adapters, "wqkv", "cpu"), batch.segments)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, base)


def test_the_stack_pads_ranks_and_parts_with_zeros():
    _, (a, b, c) = _mixed()
    stack = build_stack((a, b, c), "wqkv", "cpu")
    assert stack.rank == 32 and tuple(stack.a.shape) == (3, 3 * 32, K) and tuple(stack.b.shape) == (3, 80, 32)
    assert stack.part_offsets.tolist() == [0, 48, 64] and stack.part_sizes.tolist() == [48, 16, 16]
    assert torch.equal(stack.a[0, 32:64], torch.zeros(32, K))  # a has no k part
    assert torch.equal(stack.a[2, 32:36], c.targets["wqkv"][0].a) and not stack.a[2, 36:].any()
    assert stack.scales.tolist() == pytest.approx([0.5, 2.0, 1 / 3])
    assert build_stack((a,), "w_down", "cpu") is None


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@needs_interpreter
@pytest.mark.parametrize("prefill", [3, 20])  # BGMV (every segment <= 4 rows), SGMV (a 20-row segment)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
def test_the_kernel_adds_the_torch_paths_delta_on_a_mixed_batch(prefill, dtype, tuning):
    rows, _ = _mixed(dtype, prefill)
    base, want, got = _run_both(rows, dtype, TUNINGS[tuning])
    assert (TUNINGS[tuning].block_m(prefill) == 1) == (prefill <= 4)
    base_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[base_rows], base[base_rows])  # base-only rows untouched, bit for bit
    tol = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
    assert not torch.equal(want, base)


@needs_interpreter
@pytest.mark.parametrize("prefill", [3, 20])
def test_the_kernel_reads_the_pool_in_place(prefill):
    """The step's adapters in slots 3, 0 and 2 of a pool of rank 32 (wider than any of them): the
    kernel indexes the slots and adds the torch path's delta of the adapters as read."""
    from dataclasses import replace

    from tests.test_lora_pool import _model

    model, config = _model()
    pool = LoraPool(model, config, 4, 32, torch.float32, "cpu")
    rows, adapters = _mixed(torch.float32, prefill)
    placed = {id(ad): pool.write(slot, replace(ad, targets={"attn.wqkv": ad.targets["wqkv"]}))
              for slot, ad in zip((3, 0, 2), adapters, strict=True)}
    gen = torch.Generator().manual_seed(7)
    x, base = torch.randn(len(rows), K, generator=gen), torch.randn(len(rows), 80, generator=gen)
    want, got = base.clone(), base.clone()
    add_lora("wqkv", x, want, LoraBatch.from_rows(rows))
    batch = LoraBatch.from_rows([None if r is None else placed[id(r)] for r in rows])
    assert batch.segments.loras.tolist() == [3, 0, 2]
    lora_sgmv(x, got, pool.stack("attn.wqkv"), batch.segments, tuning=TUNINGS["sm90"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_interpreter
@pytest.mark.parametrize("name", sorted(layers.COMPILE_SPECS))
def test_each_layer_launches_on_the_workers_stacks(name):
    """Guards `_run` in layers.py: the worker's `stacked()` feeds the launch, a projection no adapter
    targets (w_down) is left alone, and the `wo` projection gets only its own part."""
    rows, _ = _mixed(torch.float32, 20)
    batch = LoraBatch.from_rows(rows)
    delta, layer = LoraDelta(), getattr(layers, name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(len(rows), K, generator=gen)
    for module, width in (("wqkv", 80), ("wo", 80), ("w_down", 80)):
        base = torch.randn(len(rows), width, generator=gen)
        want, got = base.clone(), base.clone()
        add_lora(module, x, want, batch)
        layer.forward(delta, module, x, got, batch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got, base) == (module == "w_down")


class _Recorder:
    def __init__(self, name: str):
        self.__name__, self.launches = name, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("prefill", [1, 3, 20, 300])
@pytest.mark.parametrize("name", sorted(layers.COMPILE_SPECS))
def test_the_wrappers_launches_are_declared(monkeypatch, name, prefill):
    recorders = {k: _Recorder(k) for k in ("_lora_shrink_kernel", "_lora_expand_kernel")}
    for kernel, recorder in recorders.items():
        monkeypatch.setattr(SGMV, kernel, recorder)
    monkeypatch.setattr(SGMV, "runs_triton", lambda x: True)
    tuning = TUNINGS[name.removeprefix("LoraDeltaTriton").lower()]
    declared = {(s.name, s.constexprs, s.num_warps, s.num_stages) for s in layers.COMPILE_SPECS[name](Workload())}
    rows, _ = _mixed(torch.float32, prefill)
    _run_both(rows, torch.float32, tuning)
    for kernel, recorder in recorders.items():
        kw = dict(recorder.launches[-1])
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        assert (kernel, tuple(kw.items()), warps, stages) in declared


def test_a_stack_of_another_width_is_refused_by_name():
    rows, (a, *_) = _mixed()
    batch = LoraBatch.from_rows(rows)
    with pytest.raises(ValueError, match=r"LoRA stack A \(3, 96, 40\) .* does not fit x \(28, 41\)"):
        lora_sgmv(torch.zeros(28, 41), torch.zeros(28, 80), build_stack(batch.adapters, "wqkv", "cpu"),
                  batch.segments)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_the_declared_launches_compile_and_fit_on_every_architecture_they_are_for(name):
    """Every launch this tuning declares, in the dtype each of its architectures runs, is in the
    preflight matrix for that architecture: compiled for it, fitting, without spills."""
    for arch in ARCHS[name]:
        dtype = "fp16" if arch in ("sm_70", "sm_75") else "bf16"  # no bf16 below sm_80: such a device runs fp16
        assert_recorded_launches("LoraDelta", name, arch, layers.COMPILE_SPECS[name](Workload(dtype=dtype)))


# -- the compiled kernel on a real GPU (scripts/gpu_check.sh runs these where one is lent) -----------
@pytest.mark.gpu
@pytest.mark.parametrize("prefill", [2, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_kernel_matches_the_torch_path_on_a_mixed_batch(prefill, dtype):
    """The tuning `select()` picks for this GPU, compiled, against the torch path on a batch of four
    adapters (ranks 8 to 64) and base rows over a 4096-wide q/k/v, and the time of both printed."""
    import time

    from kernels_local.mapping import select

    kind = "rocm" if torch.version.hip else "cuda"
    layer = select(kind, torch.cuda.get_device_capability(0))["LoraDelta"].layer
    if not layer.startswith("LoraDeltaTriton"):
        pytest.skip(f"this GPU runs `{layer}` (no LoRA kernel)")
    tuning = TUNINGS[layer.removeprefix("LoraDeltaTriton").lower()]
    k, parts = 4096, ((0, 4096), (4096, 1024), (5120, 1024))
    gen = torch.Generator().manual_seed(0)

    def adapter(name, rank, targets):
        pairs = tuple(LoraTarget(off, size, (torch.randn(rank, k, generator=gen) / 64).to("cuda", dtype),
                                 (torch.randn(size, rank, generator=gen) / 8).to("cuda", dtype))
                      for off, size in targets)
        return LoraAdapter(name, None, rank, rank, False, 1.0, {"wqkv": pairs})

    ads = [adapter("a", 8, parts), adapter("b", 16, parts[:1]), adapter("c", 32, parts[1:]), adapter("d", 64, parts)]
    rows = [*([ads[0]] * prefill), None, *[ads[i % 4] if i % 3 else None for i in range(64)]]
    batch = LoraBatch.from_rows(rows, "cuda")
    x = torch.randn(len(rows), k, device="cuda").to(dtype)
    base = torch.randn(len(rows), 6144, device="cuda").to(dtype)
    want, got = base.clone(), base.clone()
    add_lora("wqkv", x, want, batch)
    stack = build_stack(batch.adapters, "wqkv", "cuda")
    lora_sgmv(x, got, stack, batch.segments, tuning=tuning)
    base_rows = [i for i, r in enumerate(rows) if r is None]
    assert torch.equal(got[base_rows], base[base_rows])
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))
    timings = {}
    for label, fn in (("torch", lambda: add_lora("wqkv", x, base.clone(), batch)),
                      ("triton", lambda: lora_sgmv(x, base.clone(), stack, batch.segments, tuning=tuning))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        timings[label] = (time.perf_counter() - t0) / 20 * 1e6
    print(f"lora mixed batch {len(rows)} rows {dtype}: torch {timings['torch']:.0f} us, "
          f"triton {timings['triton']:.0f} us ({timings['torch'] / timings['triton']:.2f}x)")


def test_the_worker_kernelizes_its_lora_delta_with_the_models_plan():
    """Guards `plan.apply(delta)` in `install_lora`: the delta runs the layer the device's plan chose
    (a simulated sm_90 registers its choices for the CPU), and on CPU tensors that layer's result is
    the torch path's."""
    from kernels_local.mapping import select
    from workers.kernelize.apply import KernelPlan
    from workers.lora.apply import install_lora, lora_rows

    model = torch.nn.Sequential()
    model.add_module("wqkv", torch.nn.Linear(K, 80))
    model.kernel_plan = KernelPlan("cpu", select("cuda", (9, 0)))
    assert install_lora(model) == 1
    chosen = model.kernel_plan.choices["LoraDelta"]
    assert chosen.layer == "LoraDeltaTritonSm90"
    assert model.lora_state.delta.forward.__func__ is chosen.repository().load().forward
    rows, _ = _mixed(torch.float32, 3)
    batch, x = LoraBatch.from_rows(rows), torch.randn(len(rows), K)
    with torch.no_grad():
        want = model.wqkv(x)
        add_lora("wqkv", x, want, batch)
        with lora_rows(model, batch):
            got = model.wqkv(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_adapter_on_every_row_adds_without_a_gather_the_same_delta():
    """Guards the `whole` branch of `add_lora`: a batch of one adapter skips the gather and scatter
    and adds exactly what the gathered path (the repository's reference) adds."""
    a = _adapter("a", 8, PARTS, 1)
    batch = LoraBatch.from_rows([a] * 6)
    gen = torch.Generator().manual_seed(5)
    x, base = torch.randn(6, K, generator=gen), torch.randn(6, 80, generator=gen)
    want, got = base.clone(), base.clone()
    lora_sgmv_reference(x, want, build_stack(batch.adapters, "wqkv", "cpu"), batch.segments)
    add_lora("wqkv", x, got, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, base)


def test_a_lora_kernel_that_fails_or_disagrees_is_named_and_the_torch_path_serves():
    """Guards `check_delta` and its `to_torch_path` fallback in workers/lora/worker.py `build_loras`: a
    chosen kernel that raises or adds another delta is reported with the reason; one that agrees (the
    Triton layer, on CPU tensors its torch path or the interpreter's kernel) is not."""
    from kernels_local.mapping import select
    from workers.kernelize.apply import KernelPlan
    from workers.kernelize.selftest import to_torch_path
    from workers.lora.worker import check_delta

    a = _adapter("a", 8, PARTS, 1)
    delta = LoraDelta()
    assert check_delta(delta, a, "cpu") is None  # the torch path itself
    KernelPlan("cpu", select("cuda", (8, 0))).apply(delta)
    assert "forward" in delta.__dict__ and check_delta(delta, a, "cpu") is None
    delta.forward = lambda name, x, out, batch: 1 / 0
    assert check_delta(delta, a, "cpu").startswith("ZeroDivisionError")
    delta.forward = lambda name, x, out, batch: out.add_(1.0)
    assert "differs from the torch path by" in check_delta(delta, a, "cpu")
    assert to_torch_path(delta, "LoraDelta") == 1 and check_delta(delta, a, "cpu") is None
