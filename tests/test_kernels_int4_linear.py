"""The W4A16 Triton GEMM (kernels_local/int4_linear/) against its torch reference.

What must hold:
- the reference's weight (unpacked and dequantized as the kernel forms it) equals the loader's GPTQ
  dequantization bit for bit, so the kernel computes with the checkpoint's reference weights;
- under `TRITON_INTERPRET=1` (this file reruns itself in a child with it) the kernel equals the
  reference within fp32 rounding for odd shapes (tokens, outputs and inputs that fill no tile, a
  partial last word), every group size (groups that end inside a tile, per channel), act-order,
  bias or none, fp32 / fp16 / bf16 activations and each tuning;
- the launches the wrapper makes are among the declared `COMPILE_SPECS`, and those compile ahead of
  time and fit on every architecture each tuning is meant for (12 of the 13; sm_70 gets the
  dequantized fallback), with the 16-bit tensor-core instruction.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels_local.compile_spec import Workload
from kernels_local.int4_linear import TUNINGS, int4_linear, int4_linear_reference, layers, unpack_weight
from tests.int4_checkpoints import _words
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from tests.preflight_checks import assert_recorded_launches
from workers.quant.int4_pack import dequantize_gptq

GEMM = importlib.import_module("kernels_local.int4_linear.int4_linear")
# the architectures each tuning is for (sm_70: no 4-bit kernel, the weights are dequantized at load)
ARCHS = {"Int4LinearTritonSm75": ("sm_75",), "Int4LinearTritonSm80": ("sm_80", "sm_86", "sm_87", "sm_89"),
         "Int4LinearTritonSm90": ("sm_90", "sm_100", "sm_103", "sm_120"),
         "Int4LinearTritonRocm": ("gfx90a", "gfx942", "gfx950")}


def _layer(k: int, n: int, group: int, act_order: bool, scale_dtype=torch.float16, seed: int = 0):
    """(qweight [ceil(k/8), n], scales, zeros int8, g_idx or None) of random 4-bit values."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group == 0 else -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen)
    words = _words(torch.nn.functional.pad(q.t(), (0, -k % 8))).t().contiguous()  # [ceil(k/8), n]
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.int8)
    g_idx = None
    if act_order:
        base = torch.arange(k) // group
        g_idx = base[torch.randperm(k, generator=gen)].to(torch.int32)
    return words, scales, zeros, g_idx


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "act_order"), [(32, False), (128, False), (0, False), (64, True)])
def test_the_reference_weight_is_the_loaders_gptq_dequantization(group, act_order, scale_dtype):
    k, n = 128, 48
    words, scales, zeros, g_idx = _layer(k, n, group, act_order, scale_dtype)
    qzeros = _words(zeros.to(torch.int64))  # [groups, n / 8]: GPTQ v2 stores zero points as they are
    want = dequantize_gptq(words, qzeros, scales, g_idx, group if group else -1, 0)
    assert torch.equal(unpack_weight(words, scales, zeros, g_idx, group, k), want)


@needs_interpreter
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "act_order", "bias"), [(32, False, True), (64, False, False), (128, False, True),
                                                          (0, False, False), (32, True, False), (128, True, True)])
def test_the_kernel_equals_the_reference_on_odd_shapes(group, act_order, bias, dtype, scale_dtype):
    m, k, n = 5, 100, 40  # no tile filled; a partial last word; groups of 32 ending inside a K tile
    words, scales, zeros, g_idx = _layer(k, n, group, act_order, scale_dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    want = int4_linear_reference(x, words, scales, zeros, g_idx, b, group)
    got = int4_linear(x, words, scales, zeros, g_idx, b, group)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_interpreter
@pytest.mark.parametrize("name", list(layers.COMPILE_SPECS))
def test_each_layer_runs_its_tuning_and_equals_the_reference(name):
    words, scales, zeros, g_idx = _layer(72, 136, 32, False)
    module = torch.nn.Module()
    module.qweight, module.scales, module.zeros, module.g_idx = words, scales, zeros, g_idx
    module.group_size, module.bias, module.execution = 32, None, "w4a16"
    x = torch.randn(3, 2, 72)
    got = getattr(layers, name).forward(module, x)
    assert got.shape == (3, 2, 136)
    torch.testing.assert_close(got, int4_linear_reference(x, words, scales, zeros, g_idx, None, 32), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_a_group_size_the_kernel_has_no_variant_for_is_refused_by_name():
    words, scales, zeros, g_idx = _layer(64, 16, 32, False)
    with pytest.raises(ValueError, match=r"Unsupported int4 group size `16`\. Supported: 32, 64, 128, 0"):
        int4_linear(torch.randn(2, 64), words, scales, zeros, g_idx, None, 16)


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("name", list(layers.COMPILE_SPECS))
def test_the_wrappers_launches_are_declared(monkeypatch, name, tokens):
    recorder = _Recorder()
    monkeypatch.setattr(GEMM, "_int4_linear_kernel", recorder)
    monkeypatch.setattr(GEMM, "runs_triton", lambda x: True)
    tuning = TUNINGS[name.removeprefix("Int4LinearTriton").lower()]
    declared = {(dict(s.constexprs)["BLOCK_M"], tuple(s.constexprs), s.num_warps, s.num_stages)
                for s in layers.COMPILE_SPECS[name](Workload())}
    for group, act in ((32, False), (0, False), (128, True)):
        words, scales, zeros, g_idx = _layer(256, 256, group or 32, act)
        int4_linear(torch.randn(tokens, 256), words, scales, zeros, g_idx, torch.zeros(256), group, tuning=tuning)
        kw = dict(recorder.launches[-1])
        warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
        assert (kw["BLOCK_M"], tuple(kw.items()), warps, stages) in declared


@pytest.mark.parametrize("name", list(ARCHS))
def test_the_declared_launches_compile_and_fit_on_every_architecture_they_are_for(name):
    """Every launch this tuning declares, in the dtype each of its architectures runs, is in the
    preflight matrix for that architecture: compiled for it, fitting, without spills."""
    for arch in ARCHS[name]:
        dtype = "fp16" if arch in ("sm_70", "sm_75") else "bf16"  # no bf16 below sm_80: such a device runs fp16
        assert_recorded_launches("Int4CheckpointLinear", name, arch, layers.COMPILE_SPECS[name](Workload(dtype=dtype)),
                                 tensor_cores=True)


# -- the compiled kernel on a real GPU (scripts/gpu_check.sh runs these where one is lent) -----------
GPU_SHAPES = [(1, 4096, 4096, 128, False), (32, 4096, 4096, 128, True), (300, 14336, 4096, 128, False),
              (7, 1000, 328, 32, True), (16, 2048, 2048, 0, False), (5, 200, 96, 64, False)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "group", "act_order"), GPU_SHAPES)
def test_compiled_kernel_matches_the_reference_on_real_shapes(m, n, k, group, act_order, scale_dtype):
    """The tuning `select()` picks for this GPU, compiled, against the torch reference in bf16 and fp16
    (fp32 accumulation either way: the same weights, another summation order) and in fp32 tightly."""
    from kernels_local.mapping import select

    kind = "rocm" if torch.version.hip else "cuda"
    layer = select(kind, torch.cuda.get_device_capability(0))["Int4CheckpointLinear"].layer
    if not layer.startswith("Int4LinearTriton"):
        pytest.skip(f"this GPU runs `{layer}` (no 4-bit kernel)")
    tuning = TUNINGS[layer.removeprefix("Int4LinearTriton").lower()]
    words, scales, zeros, g_idx = (None if t is None else t.cuda() for t in _layer(k, n, group, act_order, scale_dtype))
    bias = torch.randn(n, device="cuda")
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)):
        x = torch.randn(m, k, device="cuda").to(dtype)
        got = int4_linear(x, words, scales, zeros, g_idx, bias.to(dtype), group, tuning=tuning)
        want = int4_linear_reference(x, words, scales, zeros, g_idx, bias.to(dtype), group)
        assert got.dtype == dtype and got.shape == (m, n)
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
