"""The GGUF experts' grouped GEMM (kernels_local/gguf_linear/gguf_moe.py) against its torch reference.

What must hold:
- the reference (one projection per active expert over the blocks) equals the fused MoE's own
  reference on the same experts dequantized, in fp32: the grouping, the activation, the router
  weights and the sum over top-k are the MoE layer's;
- under `TRITON_INTERPRET=1` (this file reruns itself in a child with it) the grouped kernel equals
  the reference within fp32 rounding for every type, at decode and prefill sizes, for gate and up of
  one type (the activation fused) or of two (a launch each), fp32 and bf16 activations;
- the launches the wrapper makes are among the declared `COMPILE_SPECS`, which compile without spills
  on every architecture each tuning is meant for; the kernel mapping picks the experts' layer
  wherever it picks the linear one's.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from kernels_local.compile_spec import Workload
from kernels_local.gguf_linear import MOE_TUNINGS, dequantize_rows, gguf_moe, gguf_moe_experts, layers
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter

pytest.importorskip("gguf")
from tests.preflight_checks import assert_recorded_launches  # noqa: E402
from tests.test_kernels_gguf_linear import ARCHS as LINEAR_ARCHS  # noqa: E402
from tests.test_kernels_gguf_linear import _weight  # noqa: E402

MOE = importlib.import_module("kernels_local.gguf_linear.gguf_moe")
E, H, I = 4, 256, 256  # noqa: E741
# every kernel type at least once; the third case's gate and up differ (two launches, activated in torch)
TYPE_SETS = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q5_K"), ("Q5_0", "Q4_1", "Q5_1"),
             ("IQ4_NL", "IQ4_NL", "IQ4_XS"), ("Q2_K", "Q2_K", "Q3_K"), ("Q4_0", "Q4_0", "Q4_0")]  # fmt: skip
CASES = [(t, (torch.float32, torch.bfloat16)[i % 2]) for i, t in enumerate(TYPE_SETS)]  # each type set in one dtype
ARCHS = {name.replace("Linear", "Experts"): archs for name, archs in LINEAR_ARCHS.items()}


def _experts(types: tuple[str, str, str], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up [E, I, bytes] and down [E, H, bytes] of `types`: gguf-py's blocks or random finite ones."""
    shapes = ((I, H), (I, H), (H, I))
    return tuple(_weight(t, E * rows, k, seed + p).reshape(E, rows, -1)
                 for p, (t, (rows, k)) in enumerate(zip(types, shapes, strict=True)))  # fmt: skip


def _route(tokens: int, seed: int = 0, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g) * 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])  # [T, K], distinct per token
    return x, ids, torch.rand(tokens, top_k, generator=g)


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_reference_is_the_fused_moe_reference_on_the_dequantized_experts(activation):
    from kernels_local.fused_moe import fused_moe_reference

    types = ("Q4_K", "Q8_0", "Q6_K")
    gate, up, down = _experts(types)
    w_gate_up = torch.stack([torch.cat((dequantize_rows(gate[e], types[0], H), dequantize_rows(up[e], types[1], H)))
                             for e in range(E)])  # [E, 2I, H]
    w_down = torch.stack([dequantize_rows(down[e], types[2], I) for e in range(E)])  # [E, H, I]
    x, ids, weights = _route(5)
    got = gguf_moe_experts(x, gate, up, down, types, ids, weights, activation)
    want = fused_moe_reference(x, w_gate_up, w_down, ids, weights, activation=activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 34])  # a decode's 16-row blocks; a prefill's (more than 32 tokens)
@pytest.mark.parametrize(("types", "dtype"), CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v)[6:])
def test_the_grouped_kernel_equals_the_reference(types, dtype, tokens):
    gate, up, down = _experts(types)
    x, ids, weights = _route(tokens)
    x = x.to(dtype)
    got = gguf_moe(x, gate, up, down, types, ids, weights, "silu", tuning=MOE_TUNINGS["sm80"])
    want = gguf_moe_experts(x, gate, up, down, types, ids, weights, "silu")
    assert got.dtype == dtype and got.shape == (tokens, H)
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@needs_interpreter
@pytest.mark.parametrize("name", [n for n in layers.COMPILE_SPECS if n.startswith("GGUFExperts")])
def test_each_triton_layer_runs_a_packed_module_and_a_dequantized_one(name):
    """The layer's tuning (sm70's 32-row prefill blocks, ...) and a module its worker dequantized after
    a failed self-test (`execution` "dequantized": a matmul pair per active expert)."""
    types = ("Q6_K", "Q6_K", "Q4_K")
    gate, up, down = _experts(types, seed=3)
    module = SimpleNamespace(execution="packed", gate_qweight=gate, up_qweight=up, down_qweight=down, types=types,
                             activation="gelu_tanh")  # fmt: skip
    x, ids, weights = _route(33, seed=1)
    want = gguf_moe_experts(x, gate, up, down, types, ids, weights, "gelu_tanh")
    got = getattr(layers, name).forward(module, x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    dense = SimpleNamespace(execution="dequantized", types=types, activation="gelu_tanh",
                            **{f"w_{n}": torch.stack([dequantize_rows(q[e], t, k) for e in range(E)])
                               for n, q, t, k in (("gate", gate, types[0], H), ("up", up, types[1], H),
                                                  ("down", down, types[2], I))})  # fmt: skip
    torch.testing.assert_close(getattr(layers, name).forward(dense, x, ids, weights), want, rtol=1e-5,
                               atol=1e-5 * want.abs().max().item())  # fmt: skip


def test_a_layer_refuses_a_module_loaded_for_something_else():
    module = SimpleNamespace(execution="fp8")
    x, ids, weights = _route(1)
    with pytest.raises(TypeError, match="loaded for `fp8`; it runs `packed` or `dequantized`"):
        layers.GGUFExpertsTritonSm80.forward(module, x, ids, weights)


def test_bad_experts_are_named_errors():
    types = ("Q4_K", "Q4_K", "Q6_K")
    gate, up, down = _experts(types)
    x, ids, weights = _route(2)
    with pytest.raises(ValueError, match="Unsupported GGUF expert activation `relu`. Supported: silu, gelu_tanh"):
        gguf_moe_experts(x, gate, up, down, types, ids, weights, "relu")
    with pytest.raises(ValueError, match=r"GGUF expert `down` blocks must be uint8 \[4, 256, bytes\]"):
        gguf_moe_experts(x, gate, up, down[:, :128], types, ids, weights)
    with pytest.raises(ValueError, match=r"`Q8_0` weight must be uint8 \[N, 272\] for 256 inputs"):
        gguf_moe_experts(x, gate, up, down, ("Q4_K", "Q8_0", "Q6_K"), ids, weights)
    with pytest.raises(ValueError, match=r"topk_ids and topk_weights must both be \[2, K\]"):
        gguf_moe_experts(x, gate, up, down, types, ids[:1], weights[:1])


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("tokens", [1, 32, 33, 300])
@pytest.mark.parametrize("name", [n for n in layers.COMPILE_SPECS if n.startswith("GGUFExperts")])
def test_the_wrappers_launches_are_declared(monkeypatch, name, tokens):
    declared = {(s.name, tuple(s.constexprs), s.num_warps, s.num_stages)
                for s in layers.COMPILE_SPECS[name](Workload())}
    recorder = _Recorder()
    monkeypatch.setattr(MOE, "_gguf_moe_kernel", recorder)
    monkeypatch.setattr(MOE, "runs_triton", lambda x: True)
    tuning = MOE_TUNINGS[name.removeprefix("GGUFExpertsTriton").lower()]
    for types in (("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q4_1", "IQ4_XS")):  # fused gate/up; two gate/up launches
        recorder.launches.clear()
        x, ids, weights = _route(tokens)
        gguf_moe(x.to(torch.bfloat16), *_experts(types), types, ids, weights, "silu", tuning=tuning)
        assert len(recorder.launches) == (2 if types[0] == types[1] else 3)
        for kw in recorder.launches:
            kw = dict(kw)
            warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
            assert ("_gguf_moe_kernel", tuple(kw.items()), warps, stages) in declared


def test_the_mapping_picks_the_experts_layer_wherever_it_picks_the_linear_one():
    """Guards the `GGUFExperts` entries of kernels_local/mapping.py: one GGUF rule, the same tuning family for a
    MoE layer's experts as for the linear layers, on every device."""
    from kernels_local.mapping import select

    devices = [("cpu", None)] + [("cuda", (major, minor)) for major, minor in
                                 ((6, 1), (7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0))]
    for device, cap in devices + [("rocm", (9, 0)), ("rocm", (9, 4)), ("rocm", (10, 3))]:
        chosen = select(device, cap)
        linear, experts = chosen["GGUFLinear"], chosen["GGUFExperts"]
        assert experts.layer == linear.layer.replace("GGUFLinear", "GGUFExperts"), (device, cap)
        assert experts.variant == linear.variant and experts.repo == linear.repo


@pytest.mark.parametrize("name", list(ARCHS))
def test_the_declared_launches_compile_and_fit_on_every_architecture_they_are_for(name):
    """Every launch this tuning declares, in the dtype each of its architectures runs, is in the
    preflight matrix for that architecture: compiled for it, fitting, without spills."""
    for arch in ARCHS[name]:
        dtype = "fp16" if arch in ("sm_70", "sm_75") else "bf16"
        assert_recorded_launches("GGUFExperts", name, arch, layers.COMPILE_SPECS[name](Workload(dtype=dtype)))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])  # decode; prefill
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_0", "IQ4_XS")], ids="-".join)
def test_compiled_kernel_matches_the_reference_on_a_real_layer(types, tokens):
    """The tuning `select()` picks for this GPU, compiled, against the torch reference: 8 of 64 experts of
    a 2048-wide layer, in bf16 and fp32."""
    from kernels_local.mapping import select

    kind = "rocm" if torch.version.hip else "cuda"
    layer = select(kind, torch.cuda.get_device_capability(0))["GGUFExperts"].layer
    if not layer.startswith("GGUFExpertsTriton"):
        pytest.skip(f"this GPU runs `{layer}` (no GGUF kernel)")
    tuning = MOE_TUNINGS[layer.removeprefix("GGUFExpertsTriton").lower()]
    experts, hidden, inter = 64, 2048, 768
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    gate, up, down = (_weight(t, experts * rows, k, p).reshape(experts, rows, -1).cuda()
                      for p, (t, (rows, k)) in enumerate(zip(types, shapes, strict=True)))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:8] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, 8, generator=g).cuda()
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        x = (torch.randn(tokens, hidden, generator=g) * 0.1).to(dtype).cuda()
        got = gguf_moe(x, gate, up, down, types, ids, weights, "silu", tuning=tuning)
        want = gguf_moe_experts(x, gate, up, down, types, ids, weights, "silu")
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
