"""The pre-quantized checkpoints' fp8 kernels (kernels_local/fp8_linear/checkpoint.py) against their torch
references under `TRITON_INTERPRET=1` (this file reruns itself in a child with it), their CPU paths,
the layers that run them, and their declared launches.

Weights are e4m3 bytes with scales in the one grouped layout (per row, 128 x 128 blocks, or 1 x 128
rows of blocks), shapes with tails in every dimension (a K that ends in a partial block, an N that
does not fill a tile). Activation quantizers are compared bit for bit (their values land on the
e4m3 grid in fp32 before any cast, so the interpreter's inexact fp8 cast never rounds); GEMMs against
the dequantize-then-matmul references, tightly in fp32 (only the summation order differs)."""

from __future__ import annotations

import importlib
from functools import partial

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from workers.quant.e4m3 import decode_e4m3

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


def _mods():
    ck = importlib.import_module("kernels_local.fp8_linear.checkpoint")
    quant = importlib.import_module("kernels_local.fp8_linear.quant")
    fp8 = importlib.import_module("kernels_local.fp8_linear.fp8_linear")
    return ck, quant, fp8


def _weight(n: int, k: int, fmt: str, group_n: int, group_k: int, seed: int):
    """(bytes as uint8 [N, K], scales [ceil(N/gn), ceil(K/gk)]): random bytes that are finite values."""
    gen = torch.Generator().manual_seed(seed)
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), fmt)
    finite = torch.nonzero(torch.isfinite(grid)).flatten().to(torch.uint8)
    q = finite[torch.randint(0, finite.numel(), (n, k), generator=gen)]
    scale = torch.rand(-(-n // group_n), -(-k // group_k), generator=gen) * 1e-2 + 1e-3
    return q, scale


# (M, N, K, group_n, group_k): per-row scales, 128 x 128 blocks, rows of 1 x 128 blocks
SCHEMES = [(1, 48, 96, 1, 96), (5, 136, 200, 128, 128), (33, 40, 256, 1, 128), (3, 130, 72, 128, 128)]


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,gn,gk", SCHEMES)
@needs_interpreter
def test_weight_only_gemm_matches_its_reference(m, n, k, gn, gk, dtype, fmt):
    ck, _, fp8 = _mods()
    q, scale = _weight(n, k, fmt, gn, gk, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    bias = torch.randn(n).to(dtype) if m % 2 else None
    exact = (x.float() @ ck.dequantize(q, scale, gn, gk, fmt).t() + (0 if bias is None else bias.float()))
    ref = ck.w8a16_reference(x, q, scale, gn, gk, bias, fmt)
    for tuning in (fp8.SM80, fp8.ROCM):
        y = ck.w8a16_linear(x, q, scale, gn, gk, bias, fmt=fmt, tuning=tuning)
        assert y.dtype == dtype and y.shape == (m, n)
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        else:  # the kernel scales fp32 partial sums; the reference rounds w * s to the dtype first
            torch.testing.assert_close(y.float(), exact, rtol=2e-2, atol=2e-2 * float(exact.abs().max()))


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k,gn,gk", [s for s in SCHEMES if s[4] == 128])
@needs_interpreter
def test_block_scaled_gemm_matches_its_reference(m, n, k, gn, gk, dtype, fmt):
    ck, _, fp8 = _mods()
    q, scale = _weight(n, k, fmt, gn, gk, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(n).to(dtype) if n % 2 == 0 else None
    ref = ck.w8a8_reference(x, q.view(FP8[fmt]), scale, gn, gk, None, "dynamic_group", bias, fmt)
    for tuning in (fp8.SM89, fp8.SM90, fp8.ROCM):
        y = ck.w8a8_linear(x, q.view(FP8[fmt]), scale, gn, gk, None, "dynamic_group", bias, fmt=fmt, tuning=tuning)
        assert y.dtype == dtype
        # the kernel scales each block's fp32 dot before adding; the reference dequantizes first
        torch.testing.assert_close(y.float(), ref.float(), rtol=1e-5 if dtype == torch.float32 else 1.6e-2,
                                   atol=1e-5 * float(ref.float().abs().max()) + 1e-6)  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("activations", ["dynamic_token", "static_tensor"])
@needs_interpreter
def test_per_row_native_gemm_with_dynamic_and_static_activations(activations, fmt):
    ck, _, fp8 = _mods()
    m, n, k = 7, 40, 96
    q, scale = _weight(n, k, fmt, 1, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 3
    inp = torch.tensor(0.01) if activations == "static_tensor" else None  # saturates the largest inputs
    ref = ck.w8a8_reference(x, q.view(FP8[fmt]), scale, 1, k, inp, activations, None, fmt)
    for tuning in (fp8.SM89, fp8.SM90, fp8.ROCM):
        y = ck.w8a8_linear(x, q.view(FP8[fmt]), scale, 1, k, inp, activations, None, fmt=fmt, tuning=tuning)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FP8))
@needs_interpreter
def test_group_and_static_quantizers_match_the_torch_ones(fmt):
    """Bit for bit: exact ties, subnormals, saturation (static), zero rows, a partial last group."""
    _, quant, _ = _mods()
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), fmt)
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
    row = torch.cat([grid, (grid[:-1] + grid[1:]) / 2])
    rows = torch.stack([row, row * 3.7, torch.zeros_like(row), torch.randn(row.numel()) * 1e-3])[:, :200]
    want_grid, want_scale = quant.quantize_groups(rows, fmt, 128)
    assert want_scale.shape == (4, 2)
    for out_dtype in (FP8[fmt], torch.float16):
        q, s = quant.quantize_groups_triton(rows, fmt, 128, out_dtype)
        assert torch.equal(s, want_scale) and torch.equal(q.to(torch.float32), want_grid)
        static = torch.tensor(0.5)  # row * 3.7 / 0.5 passes the format's max: saturated
        want_q, want_s = quant.quantize_static(rows, static, fmt)
        q, s = quant.quantize_static_triton(rows, static, fmt, out_dtype)
        assert torch.equal(s, want_s) and torch.equal(q.to(torch.float32), want_q)
        assert float(want_q.abs().max()) == quant.get_format(fmt).max_value


@pytest.mark.skipif(INTERPRETED, reason="the CPU path: kernels made under the interpreter run Triton on CPU tensors")
def test_the_cpu_paths_are_the_references():
    """A simulated device computes on the CPU: native per-row scales through `torch._scaled_mm`
    (e4m3fn), bit for bit the reference; blocks, fnuz and weight-only are the references themselves."""
    ck, _, _ = _mods()
    q, scale = _weight(40, 96, "e4m3fn", 1, 96, seed=1)
    x = torch.randn(5, 96)
    for act, inp in (("dynamic_token", None), ("static_tensor", torch.tensor(0.02))):
        y = ck.w8a8_linear(x, q.view(torch.float8_e4m3fn), scale, 1, 96, inp, act, None, fmt="e4m3fn",
                           tuning=ck.SM80)  # fmt: skip
        assert torch.equal(y, ck.w8a8_reference(x, q.view(torch.float8_e4m3fn), scale, 1, 96, inp, act, None,
                                                "e4m3fn"))  # fmt: skip
    y = ck.w8a16_linear(x, q, scale, 1, 96, None, fmt="e4m3fn")
    assert torch.equal(y, ck.w8a16_reference(x, q, scale, 1, 96, None, "e4m3fn"))


def test_the_kernels_refuse_buffers_of_another_execution():
    ck, _, _ = _mods()
    q, scale = _weight(16, 32, "e4m3fn", 1, 32, seed=0)
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="weight-only fp8 stores uint8 bytes, got `torch.float8_e4m3fn`"):
        ck.w8a16_linear(x, q.view(torch.float8_e4m3fn), scale, 1, 32, None, fmt="e4m3fn")
    with pytest.raises(TypeError, match="native fp8 weight has dtype `torch.uint8`"):
        ck.w8a8_linear(x, q, scale, 1, 32, None, "dynamic_token", None, fmt="e4m3fn", tuning=ck.SM80)


# -- the declared launches (no compile: stand-in kernels record what the wrappers launch) -----------


_KERNELS = (("checkpoint", "_fp8_block_gemm_kernel"), ("checkpoint", "_per_row_kernel"),
            ("checkpoint", "_fp8_w8a16_kernel"), ("quant", "_quantize_rows_kernel"),
            ("quant", "_quantize_groups_kernel"), ("quant", "_quantize_static_kernel"))


def _check_launches(monkeypatch, call, specs) -> int:
    """Run `call` with every kernel recorded; each launch must be a declared spec: constexprs,
    warps, stages and the type Triton's JIT gives each runtime argument. Returns the launches."""
    from tests.test_compile_specs import _jit_type, _Recorder

    mods = dict(zip(("checkpoint", "quant"), _mods()[:2], strict=True))
    recorded = []
    for mod, name in _KERNELS:
        real = getattr(mods[mod], name)
        rec = _Recorder(real.__name__)
        monkeypatch.setattr(mods[mod], name, rec)
        recorded.append((mod, name, real, rec))
    call()
    launches = 0
    for mod, name, kernel, rec in recorded:
        monkeypatch.setattr(mods[mod], name, kernel)
        for args, kw in rec.launches:
            warps, stages = kw.pop("num_warps"), kw.pop("num_stages", 3)
            types = [_jit_type(kernel, a, v) for a, v in zip(kernel.arg_names, args, strict=False)]
            match = [s for s in specs if s.name == kernel.__name__ and s.constexprs == tuple(kw.items())
                     and (s.num_warps, s.num_stages) == (warps, stages)]  # fmt: skip
            assert match, (name, kw, warps, stages)
            assert types in [[t for _, t in s.args] for s in match], (name, types)
            launches += 1
    return launches


@pytest.mark.skipif(INTERPRETED, reason="records launches instead of running them")
@pytest.mark.parametrize("tokens", [1, 16, 40, 200])
def test_declared_specs_are_what_the_wrappers_launch(monkeypatch, tokens):
    """Guards `w8a8_specs` / `w8a16_specs` (and the kernels' `do_not_specialize` lists): every launch
    `w8a8_linear` and `w8a16_linear` make, per-row or block scales, dynamic, static or grouped
    activations, is one the preflight compiles, argument type for argument type."""
    from kernels_local.compile_spec import Workload

    ck, _, fp8 = _mods()
    monkeypatch.setattr(ck, "runs_triton", lambda x: True)
    k, n = 688, 256  # K not a multiple of 16 or of the block, as a model's own width may be
    for fmt in sorted(FP8):
        x = torch.ones(tokens, k, dtype=torch.bfloat16)
        blk, row = _weight(n, k, fmt, 128, 128, seed=0), _weight(n, k, fmt, 1, k, seed=0)
        cases = (("dynamic_group", blk, 128, 128), ("static_tensor", row, 1, k), ("dynamic_token", row, 1, k))
        for tuning in (fp8.SM89, fp8.SM90, fp8.ROCM):
            specs = ck.w8a8_specs(tuning, Workload(dtype="bf16", widths=(k, n), max_tokens=tokens, fp8_fmt=fmt))
            for act, (q, s), gn, gk in cases:
                call = partial(ck.w8a8_linear, x, q.view(FP8[fmt]), s, gn, gk, torch.tensor(0.1), act,
                               torch.ones(n, dtype=x.dtype), fmt=fmt, tuning=tuning)  # fmt: skip
                assert _check_launches(monkeypatch, call, specs) == 2
        for tuning in (fp8.SM80, fp8.ROCM):
            for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                specs = ck.w8a16_specs(tuning, Workload(dtype=name, widths=(k, n), max_tokens=tokens, fp8_fmt=fmt))
                for _, (q, s), gn, gk in cases[:2]:
                    call = partial(ck.w8a16_linear, x.to(dtype), q, s, gn, gk, torch.ones(n, dtype=dtype), fmt=fmt,
                                   tuning=tuning)  # fmt: skip
                    assert _check_launches(monkeypatch, call, specs) == 1


def test_each_checkpoint_layer_runs_its_execution_with_the_tuning_its_specs_declare(monkeypatch):
    """Guards the `Fp8CheckpointLinear*` entries of `COMPILE_SPECS` and their forwards: each Triton
    layer passes the tuning its specs were built with, to the wrapper of its execution, and refuses a
    module prepared for another execution (a buffer made for one never reaches another's kernel)."""
    layers = importlib.import_module("kernels_local.fp8_linear.layers")
    seen = {}
    monkeypatch.setattr(layers, "w8a8_linear", lambda *a, **kw: seen.update(run="native", tuning=kw["tuning"]))
    monkeypatch.setattr(layers, "w8a16_linear", lambda *a, **kw: seen.update(run="weight_only", tuning=kw["tuning"]))
    module = torch.nn.Module()
    module.qweight, module.weight_scale, module.group_n, module.group_k = None, None, 1, 4
    module.input_scale, module.activations, module.bias, module.fp8_fmt = None, "dynamic_token", None, "e4m3fn"
    names = [n for n in layers.COMPILE_SPECS if n.startswith("Fp8CheckpointLinear")]
    assert len(names) == 5
    for name in names:
        spec = layers.COMPILE_SPECS[name]
        execution = "native" if "Native" in name else "weight_only"
        module.execution = execution
        getattr(layers, name).forward(module, torch.ones(2, 4))
        assert seen == {"run": execution, "tuning": spec.args[0]}, name
        module.execution = "dequantized"
        with pytest.raises(TypeError, match=f"`{execution}` execution got a module prepared for `dequantized`"):
            getattr(layers, name).forward(module, torch.ones(2, 4))
    module.execution, module.weight = "dequantized", torch.eye(4)
    assert torch.equal(layers.Fp8CheckpointLinear.forward(module, torch.ones(2, 4)), torch.ones(2, 4))
