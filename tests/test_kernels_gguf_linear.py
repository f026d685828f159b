"""The GGUF linear kernels (kernels_local/gguf_linear/) against their torch reference.

What must hold:
- the reference's weight (each element decoded with the kernel's own index arithmetic) equals
  gguf-py's `dequantize` bit for bit, on blocks from gguf-py's quantizer where it has one (Q8_0,
  Q4_0..Q5_1) and random blocks with finite fp16 scales for the K- and IQ4 types, which gguf-py
  only dequantizes;
- under `TRITON_INTERPRET=1` (this file reruns itself in a child with it) the GEMV (decode) and the
  GEMM (prefill) equal the dequantize-then-matmul reference within fp32 rounding for every type,
  outputs that fill no tile, bias or none, fp32 and bf16 activations;
- the launches the wrapper makes are among the declared `COMPILE_SPECS`, and those compile ahead of
  time without spills on every architecture each tuning is meant for;
- the per-device rule (workers/gguf/execution.py) and the kernel mapping agree.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from kernels_local.compile_spec import Workload
from kernels_local.gguf_linear import (
    BLOCKS,
    GEMV_MAX_M,
    TUNINGS,
    dequantize_rows,
    gguf_linear,
    gguf_linear_reference,
    layers,
)
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.preflight_checks import assert_recorded_launches  # noqa: E402

KERNEL = importlib.import_module("kernels_local.gguf_linear.gguf_linear")
QUANTIZED_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# byte offsets of each block's fp16 scales (d, dmin) in the types gguf-py cannot quantize
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_NL": (0,), "IQ4_XS": (0,)}
ARCHS = {"GGUFLinearTritonSm70": ("sm_70", "sm_75"), "GGUFLinearTritonSm80": ("sm_80", "sm_86", "sm_87", "sm_89"),
         "GGUFLinearTritonSm90": ("sm_90", "sm_100", "sm_103", "sm_120"),
         "GGUFLinearTritonRocm": ("gfx90a", "gfx942", "gfx950")}


def _weight(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, k / QK * TYPE_SIZE]: gguf-py's quantization of random values, or random blocks with finite
    fp16 scales (normal, 1e-3 to 1: outputs of a size the fp32 tolerance reads well)."""
    rng = np.random.default_rng(seed)
    qk, size = BLOCKS[name]
    if name in QUANTIZED_BY_GGUF:
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return torch.from_numpy(gguf.quants.quantize(values, T[name]).view(np.uint8).copy())
    raw = rng.integers(0, 256, size=(n, k // qk, size), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        scales = (rng.choice([-1, 1], size=(n, k // qk)) * 10 ** rng.uniform(-3, 0, size=(n, k // qk)))
        raw[..., offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(n, k // qk, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def test_every_kernel_type_has_a_case():
    assert set(QUANTIZED_BY_GGUF) | set(FP16_FIELDS) == set(BLOCKS)


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_reference_weight_is_gguf_pys_dequantization(name):
    qk, _ = BLOCKS[name]
    raw = _weight(name, 5, 2 * max(qk, 64), seed=1)
    if name in FP16_FIELDS:  # subnormal scales too, as the loader's own parity test draws them
        raw = torch.from_numpy(_subnormal_scales(raw.numpy().copy(), name))
    want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw.numpy(), T[name])))
    got = dequantize_rows(raw, name, want.shape[1])
    assert torch.isfinite(want).all() and torch.equal(got, want)


def _subnormal_scales(raw: np.ndarray, name: str) -> np.ndarray:
    _, size = BLOCKS[name]
    blocks = raw.reshape(raw.shape[0], -1, size)
    rng = np.random.default_rng(3)
    for offset in FP16_FIELDS[name]:
        scales = rng.uniform(1e-7, 6e-5, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(raw.shape)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, GEMV_MAX_M, GEMV_MAX_M + 1, 19])  # the GEMV's edge, the GEMM's first rows
@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_kernel_equals_the_reference(name, m, dtype):
    """N = 11 fills no tile (masked rows), K = two blocks of the type (or 64 inputs, two GEMM tiles)."""
    qk, _ = BLOCKS[name]
    k, n = max(2 * qk, 64), 11
    w = _weight(name, n, k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    got = gguf_linear(x, w, name, bias)
    want = gguf_linear_reference(x, w, name, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = float(want.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output apart at most
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@needs_interpreter
@pytest.mark.parametrize("name", ["GGUFLinear", *(n for n in layers.COMPILE_SPECS if n.startswith("GGUFLinear"))])
def test_each_layer_runs_a_packed_module_and_a_dequantized_one(name):
    w = _weight("Q4_K", 8, 256)
    module = torch.nn.Module()
    module.execution, module.qweight, module.gguf_type, module.bias = "packed", w, "Q4_K", None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    layer = getattr(layers, name)
    want = gguf_linear_reference(x, w, "Q4_K")
    # fp32 sums of 256 products in another order: 1e-5 of the outputs' scale (outputs reach ~5)
    torch.testing.assert_close(layer.forward(module, x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    module.execution, module.weight = "dequantized", dequantize_rows(w, "Q4_K", 256)
    torch.testing.assert_close(layer.forward(module, x), x @ module.weight.t(), rtol=1e-5, atol=1e-5)
    module.execution = "w4a16"
    with pytest.raises(TypeError, match="`w4a16`"):
        layer.forward(module, x)


@pytest.mark.parametrize("name", [n for n in layers.COMPILE_SPECS if n.startswith("GGUFLinear")])
def test_each_layer_passes_the_tuning_its_specs_declare(monkeypatch, name):
    """Guards `COMPILE_SPECS`: a layer whose forward passed another tuning than its entry would be
    preflighted with the wrong tile shapes."""
    seen = {}
    monkeypatch.setattr(layers, "gguf_linear", lambda *a, **kw: seen.update(tuning=kw["tuning"]))
    module = torch.nn.Module()
    module.execution, module.qweight, module.gguf_type, module.bias = "packed", _weight("Q8_0", 4, 64), "Q8_0", None
    getattr(layers, name).forward(module, torch.ones(2, 64))
    assert seen["tuning"] is layers.COMPILE_SPECS[name].args[0]


def test_a_weight_of_the_wrong_layout_is_a_named_error():
    w = _weight("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="`IQ2_XXS`"):
        gguf_linear(torch.randn(1, 64), w, "IQ2_XXS")
    with pytest.raises(ValueError, match="`48`"):
        gguf_linear(torch.randn(1, 48), w, "Q8_0")
    with pytest.raises(ValueError, match="uint8"):
        gguf_linear(torch.randn(1, 96), w, "Q8_0")


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("tokens", [1, GEMV_MAX_M, 7, 300])
@pytest.mark.parametrize("name", [n for n in layers.COMPILE_SPECS if n.startswith("GGUFLinear")])
def test_the_wrappers_launches_are_declared(monkeypatch, name, tokens):
    declared = {(s.name, tuple(s.constexprs), s.num_warps, s.num_stages)
                for s in layers.COMPILE_SPECS[name](Workload())}
    gemv, gemm = _Recorder(), _Recorder()
    monkeypatch.setattr(KERNEL, "_gguf_gemv_kernel", gemv)
    monkeypatch.setattr(KERNEL, "_gguf_gemm_kernel", gemm)
    monkeypatch.setattr(KERNEL, "runs_triton", lambda x: True)
    tuning = TUNINGS[name.removeprefix("GGUFLinearTriton").lower()]
    for type_name, bias in (("Q4_K", None), ("Q8_0", torch.zeros(256)), ("IQ4_XS", None)):
        gguf_linear(torch.randn(tokens, 256), _weight(type_name, 256, 256), type_name, bias, tuning=tuning)
        recorder = gemv if tokens <= GEMV_MAX_M else gemm
        kw = dict(recorder.launches[-1])
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        kernel = "_gguf_gemv_kernel" if tokens <= GEMV_MAX_M else "_gguf_gemm_kernel"
        assert (kernel, tuple(kw.items()), warps, stages) in declared


def test_the_device_rule_and_the_kernel_mapping_agree():
    """Guards `gguf_rule`'s ranges (CUDA from sm_70 and ROCm packed; the CPU too, for its C++ kernel): each
    GPU whose rule keeps the blocks packed gets a Triton GGUF layer from the mapping, the CPU its C++
    GEMV's layer, every other the torch layer."""
    from kernels_local.mapping import select
    from workers.gguf.execution import KERNEL as RULE_KERNEL
    from workers.gguf.execution import PACKED, gguf_rule

    devices = [("cpu", None)] + [("cuda", (major, minor)) for major, minor in
                                 ((6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))]
    devices += [("rocm", (9, 0)), ("rocm", (9, 4)), ("rocm", (9, 5))]
    for device, cap in devices:
        rule, choice = gguf_rule(device, cap), select(device, cap)["GGUFLinear"]
        kernel = "cpp" if device == "cpu" else "triton"
        assert (rule.execution == PACKED) == (kernel in choice.variant), (device, cap, rule, choice)
        assert (rule.kernel == RULE_KERNEL) == (rule.execution == PACKED)
        assert rule.reason


@pytest.mark.parametrize("name", list(ARCHS))
def test_the_declared_launches_compile_and_fit_on_every_architecture_they_are_for(name):
    """Every launch this tuning declares, in the dtype each of its architectures runs, is in the
    preflight matrix for that architecture: compiled for it, fitting, without spills."""
    for arch in ARCHS[name]:
        dtype = "fp16" if arch in ("sm_70", "sm_75") else "bf16"  # no bf16 below sm_80: such a device runs fp16
        assert_recorded_launches("GGUFLinear", name, arch, layers.COMPILE_SPECS[name](Workload(dtype=dtype)))


# -- the compiled kernels on a real GPU (scripts/gpu_check.sh runs these where one is lent; every type is
#    checked and timed there by benchmarks/gguf_kernels.py, so these stay few: each launch compiles) -------
GPU_SHAPES = [(1, 4096, 4096), (300, 1000, 2048)]  # decode (the GEMV), prefill with outputs that fill no tile


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), GPU_SHAPES)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS"])  # Q4_K_M's two types, Q8_0, IQ4's grid
def test_compiled_kernel_matches_the_reference_on_real_shapes(name, m, n, k):
    """The tuning `select()` picks for this GPU, compiled, against the torch reference in bf16 (the same
    weights, another summation order) and in fp32 tightly, with a bias."""
    from kernels_local.mapping import select

    kind = "rocm" if torch.version.hip else "cuda"
    layer = select(kind, torch.cuda.get_device_capability(0))["GGUFLinear"].layer
    if not layer.startswith("GGUFLinearTriton"):
        pytest.skip(f"this GPU runs `{layer}` (no GGUF kernel)")
    tuning = TUNINGS[layer.removeprefix("GGUFLinearTriton").lower()]
    w = _weight(name, n, k).cuda()
    bias = torch.randn(n, device="cuda")
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        x = torch.randn(m, k, device="cuda").to(dtype)
        got = gguf_linear(x, w, name, bias.to(dtype), tuning=tuning)
        want = gguf_linear_reference(x, w, name, bias.to(dtype))
        assert got.dtype == dtype and got.shape == (m, n)
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
