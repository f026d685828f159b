"""The fp8 experts' grouped GEMM (kernels_local/fused_moe/fp8.py) against its torch reference under
`TRITON_INTERPRET=1` (this file reruns itself in a child with it), the model's `Fp8FusedMoE`
reference against the repository's, the layers' execution checks, and the declared launches.

Weights are random finite e4m3 bytes with scales in the grouped layout (per row, 128 x 128 blocks,
rows of 1 x 128 blocks), shapes with tails in every dimension (H = 144: two K groups, the last
partial; I = 40), routings with experts that receive no token and top-k 1 and 2. Activations that
the native path quantizes land on the e4m3 grid in fp32 before any cast, so the interpreter's
inexact fp8 cast never rounds; the GEMMs are compared tightly in fp32 (only the summation order and
where the scales multiply differ)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from workers.quant.e4m3 import decode_e4m3

FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
E, H, INTER = 4, 144, 40


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


def _fp8():
    return importlib.import_module("kernels_local.fused_moe.fp8")


def _bytes(shape, fmt: str, gen) -> torch.Tensor:
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), fmt)
    finite = torch.nonzero(torch.isfinite(grid)).flatten().to(torch.uint8)
    return finite[torch.randint(0, finite.numel(), shape, generator=gen)]


def experts(fmt: str, execution: str, groups: tuple[int, int], activations: str = "dynamic_token",
            bias: bool = False, activation: str = "silu", dtype=torch.float32, seed: int = 0):  # fmt: skip
    """Stand-in for the model's prepared `Fp8FusedMoE`: the attributes the kernel layers read."""
    gen = torch.Generator().manual_seed(seed)
    gn, gk = groups
    out = SimpleNamespace(fp8_fmt=fmt, execution=execution, activations=activations, activation=activation,
                          alpha=1.702, limit=7.0, row_tile=None, input_scales=None)  # fmt: skip
    for name, (n, k) in (("w_gate_up", (2 * INTER, H)), ("w_down", (H, INTER))):
        q = _bytes((E, n, k), fmt, gen)
        gk_here = k if gk is None else gk  # per row: one column of scales
        scale = torch.rand(E, -(-n // gn), -(-k // gk_here), generator=gen) * 2e-2 + 2e-3
        setattr(out, f"{name}_q", q if execution == "weight_only" else q.view(FP8[fmt]))
        setattr(out, f"{name}_scale", scale)
        setattr(out, name.removeprefix("w_") + "_groups", (gn, gk_here))
    if activations == "static_tensor":
        out.input_scales = (torch.tensor(0.02), torch.tensor(0.05))  # small: the largest inputs saturate
    out.b_gate_up = (torch.randn(E, 2 * INTER, generator=gen) * 0.1).to(dtype) if bias else None
    out.b_down = (torch.randn(E, H, generator=gen) * 0.1).to(dtype) if bias else None
    return out


def routing(tokens: int, k: int, seed: int = 0):
    """Top-k ids over experts 0, 2 and 3 only (expert 1 gets no token), softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.tensor([0, 2, 3])[torch.randperm(3, generator=gen)[:k]] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)


GROUPS = {"per-row": (1, None), "block": (128, 128), "row-blocks": (1, 128)}
ACTIVATIONS = {"per-row": "dynamic_token", "block": "dynamic_group", "row-blocks": "dynamic_group"}


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scheme", sorted(GROUPS))
@pytest.mark.parametrize("tokens,k", [(1, 1), (5, 2)])
@needs_interpreter
def test_weight_only_kernel_matches_its_reference(tokens, k, scheme, dtype, fmt):
    fp8 = _fp8()
    from kernels_local.fused_moe.fused_moe import PRE_HOPPER, ROCM

    ex = experts(fmt, "weight_only", GROUPS[scheme], bias=tokens > 1, activation="swiglu_oai" if k == 1 else "silu",
                 dtype=dtype, seed=tokens)  # fmt: skip
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(k)).to(dtype)
    ids, weights = routing(tokens, k)
    ref = fp8.fused_moe_fp8_reference(x, ex, ids, weights)
    for tuning in (PRE_HOPPER, ROCM):
        y = fp8.fused_moe_fp8(x, ex, ids, weights, native=False, tuning=tuning)
        assert y.dtype == dtype and y.shape == (tokens, H)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max()))


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("scheme,activations", [("per-row", "dynamic_token"), ("per-row", "static_tensor"),
                                                ("block", "dynamic_group"), ("row-blocks", "dynamic_group")])
@needs_interpreter
def test_native_kernel_matches_its_reference(scheme, activations, fmt):
    fp8 = _fp8()
    from kernels_local.fused_moe.fused_moe import HOPPER, PRE_HOPPER, ROCM

    ex = experts(fmt, "native", GROUPS[scheme], activations, bias=True, seed=7)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(6, 2, seed=1)
    ref = fp8.fused_moe_fp8_reference(x, ex, ids, weights)
    for tuning in (PRE_HOPPER, HOPPER, ROCM):
        y = fp8.fused_moe_fp8(x, ex, ids, weights, native=True, tuning=tuning)
        # the kernel scales each K tile's fp32 dot before adding it; the reference dequantizes first
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_the_activation_quantizer_rounds_once_onto_the_grid(fmt):
    """Per token, per 128 columns (a partial last group), static (saturating): each value is the
    fp32 quotient rounded once onto the format's grid, and the scales are amax / max."""
    fp8 = _fp8()
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0)) * 4
    top = fp8.MAX_VALUES[fmt]
    q, s = fp8.quantize_activations(x, "dynamic_token", fmt)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / top) and q.dtype == FP8[fmt]
    assert torch.equal(q.float(), (x / s).to(FP8[fmt]).float())
    q, s = fp8.quantize_activations(x, "dynamic_group", fmt)
    assert s.shape == (3, 2) and torch.equal(s[:, 1], x[:, 128:].abs().amax(-1) / top)
    q, s = fp8.quantize_activations(x, "static_tensor", fmt, torch.tensor(0.001))
    assert float(q.float().abs().max()) == top and torch.equal(s, torch.full((3, 1), 0.001))


# -- the model's layer, the layers of the repository, the mapping ----------------------------------


def _model_experts(execution: str, fmt: str, scheme: str, dtype=torch.float32):
    """The model's `Fp8FusedMoE`, filled with stored bytes and prepared for `execution`."""
    from workers.quant.experts import Fp8FusedMoE
    from workers.quant.scheme import Fp8Scheme

    gn, gk = GROUPS[scheme]
    block = scheme == "block"
    s = Fp8Scheme("block" if block else "channel", "dynamic_group" if block else "dynamic_token",
                  (128, 128) if block else None)  # fmt: skip
    layer = Fp8FusedMoE(E, H, INTER, s, (gn, gk or H), (gn, gk or INTER), bias=True, dtype=dtype, device="cpu")
    ref = experts("e4m3fn", "native", GROUPS[scheme], seed=5)
    with torch.no_grad():
        for name in ("w_gate_up", "w_down"):
            getattr(layer, f"{name}_q").copy_(getattr(ref, f"{name}_q"))
            getattr(layer, f"{name}_scale").copy_(getattr(ref, f"{name}_scale"))
        layer.b_gate_up.normal_(0, 0.1)
        layer.b_down.normal_(0, 0.1)
    layer.prepare(execution, fmt)
    return layer


@pytest.mark.skipif(INTERPRETED, reason="torch paths only")
@pytest.mark.parametrize("scheme", ["per-row", "block"])
@pytest.mark.parametrize("execution,fmt", [("dequantized", "e4m3fn"), ("weight_only", "e4m3fn"),
                                           ("weight_only", "e4m3fnuz"), ("native", "e4m3fn"), ("native", "e4m3fnuz")])
def test_the_models_reference_is_the_repositorys_bit_for_bit(execution, fmt, scheme):
    """Every execution of the model's `Fp8FusedMoE.forward` equals the kernel repository's torch path
    (which the simulated devices run), and the fnuz conversion changes no weight's value."""
    layers = importlib.import_module("kernels_local.fused_moe.layers")
    layer = _model_experts(execution, fmt, scheme)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    ids, weights = routing(7, 2, seed=3)
    want = layer(x, ids, weights)
    cls = {"dequantized": "Fp8FusedMoE", "weight_only": "Fp8FusedMoETritonW8A16Sm80",
           "native": "Fp8FusedMoETritonNativeSm90"}[execution]  # fmt: skip
    assert torch.equal(getattr(layers, cls).forward(layer, x, ids, weights), want)
    fn = _model_experts("dequantized", "e4m3fn", scheme)
    if execution != "dequantized":
        from workers.quant.e4m3 import dequantize_weight

        for name, groups in (("w_gate_up", layer.gate_up_groups), ("w_down", layer.down_groups)):
            q, s = getattr(layer, f"{name}_q"), getattr(layer, f"{name}_scale")
            values = torch.stack([dequantize_weight(q[e], s[e], *groups, fmt) for e in range(E)])
            assert torch.equal(values, getattr(fn, name)), name


def test_each_layer_refuses_experts_prepared_for_another_execution_and_passes_its_tuning(monkeypatch):
    """Guards the `Fp8FusedMoE*` entries of `COMPILE_SPECS` and their forwards: each Triton layer runs
    its execution with the tuning its specs were built with, and refuses a module prepared for another."""
    layers = importlib.import_module("kernels_local.fused_moe.layers")
    seen = {}
    monkeypatch.setattr(layers, "fused_moe_fp8", lambda *a, **kw: seen.update(native=kw["native"], tuning=kw["tuning"]))
    names = [n for n in layers.COMPILE_SPECS if n.startswith("Fp8FusedMoE")]
    assert len(names) == 5
    x, (ids, weights) = torch.ones(2, H), routing(2, 1)
    for name in names:
        spec = layers.COMPILE_SPECS[name]
        execution = "native" if spec.keywords["native"] else "weight_only"
        module = SimpleNamespace(execution=execution, row_tile=None)
        getattr(layers, name).forward(module, x, ids, weights)
        assert seen == {"native": spec.keywords["native"], "tuning": spec.args[0]}, name
        module.execution = "dequantized"
        with pytest.raises(TypeError, match=f"`{execution}` execution got a module prepared for `dequantized`"):
            getattr(layers, name).forward(module, x, ids, weights)
    with pytest.raises(TypeError, match="`dequantized` execution got a module prepared for `native`"):
        layers.Fp8FusedMoE.forward(SimpleNamespace(execution="native"), x, ids, weights)


def test_the_mapping_gives_every_device_the_expert_execution_of_the_fp8_rule():
    """The `Fp8FusedMoE` kernel of every capability runs what `fp8_execution` says, like the linear layers'."""
    from kernels_local.mapping import select
    from workers.contract import fp8_execution

    devices = [("cpu", None)] + [("cuda", (m, n)) for m, n in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                                                                  (10, 0), (12, 0))]  # fmt: skip
    devices += [("rocm", c) for c in ((9, 0), (9, 4), (9, 5), (11, 0))]
    for device in devices:
        choices = select(*device)
        assert choices["Fp8FusedMoE"].fp8 == fp8_execution(*device).kind == choices["Fp8CheckpointLinear"].fp8, device


# -- the declared launches (stand-in kernels record what the wrapper launches) ---------------------


@pytest.mark.skipif(INTERPRETED, reason="records launches instead of running them")
@pytest.mark.parametrize("tokens,k", [(1, 1), (3, 4), (40, 2), (200, 8)])
def test_declared_specs_are_what_the_wrapper_launches(monkeypatch, tokens, k):
    """Guards `fp8_compile_specs` and the kernel's `do_not_specialize` list: every launch of
    `fused_moe_fp8`, weight-only or native, per-row or block scales, per-token, grouped or static
    activations, top-k 1..8, is a declared spec, constexpr for constexpr, argument type for type."""
    from kernels_local.compile_spec import Workload
    from kernels_local.fused_moe.fused_moe import TUNINGS
    from tests.test_compile_specs import _jit_type, _Recorder

    fp8 = _fp8()
    kernel = fp8._moe_fp8_gemm_kernel
    monkeypatch.setattr(fp8, "runs_triton", lambda x: True)
    h, i = 2048, 768  # Qwen3-30B-A3B's widths
    for fmt in sorted(FP8):
        for execution, dtype, name in (("weight_only", torch.bfloat16, "bf16"), ("weight_only", torch.float32, "fp32"),
                                       ("native", torch.bfloat16, "bf16")):  # fmt: skip
            for scheme, activations in (("per-row", "dynamic_token"), ("block", "dynamic_group"),
                                        ("per-row", "static_tensor")):  # fmt: skip
                ex = SimpleNamespace(fp8_fmt=fmt, execution=execution, activations=activations, activation="silu",
                                     alpha=1.7, limit=7.0, b_gate_up=None, b_down=torch.zeros(8, h, dtype=dtype),
                                     input_scales=(torch.tensor(1.0), torch.tensor(1.0)))  # fmt: skip
                gn, gk = GROUPS[scheme]
                store = torch.uint8 if execution == "weight_only" else FP8[fmt]
                ex.w_gate_up_q, ex.w_down_q = torch.zeros(8, 2 * i, h, dtype=store), torch.zeros(8, h, i, dtype=store)
                ex.w_gate_up_scale = torch.ones(8, -(-2 * i // gn), -(-h // (gk or h)))
                ex.w_down_scale = torch.ones(8, -(-h // gn), -(-i // (gk or i)))
                ex.gate_up_groups, ex.down_groups = (gn, gk or h), (gn, gk or i)
                x = torch.zeros(tokens, h, dtype=dtype)
                ids = torch.arange(tokens * k).view(tokens, k) % 8
                for tuning in TUNINGS.values():
                    specs = fp8.fp8_compile_specs(tuning, Workload(dtype=name, widths=(h, i), max_tokens=tokens,
                                                                   fp8_fmt=fmt), native=execution == "native")
                    rec = _Recorder(kernel.__name__)
                    monkeypatch.setattr(fp8, "_moe_fp8_gemm_kernel", rec)
                    fp8.fused_moe_fp8(x, ex, ids, torch.ones(tokens, k), native=execution == "native", tuning=tuning)
                    monkeypatch.setattr(fp8, "_moe_fp8_gemm_kernel", kernel)
                    assert len(rec.launches) == 2
                    for args, kw in rec.launches:
                        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
                        types = [_jit_type(kernel, n, v) for n, v in zip(kernel.arg_names, args, strict=False)]
                        match = [s for s in specs if s.constexprs == tuple(kw.items())
                                 and (s.num_warps, s.num_stages) == (warps, stages)]  # fmt: skip
                        assert match, (execution, scheme, kw)
                        assert types in [[t for _, t in s.args] for s in match], (execution, scheme, types)

