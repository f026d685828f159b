"""gpt-oss's MXFP4 experts kept packed: the grouped GEMM (kernels_local/fused_moe/mxfp4.py) against its
torch reference under `TRITON_INTERPRET=1` (this file reruns itself in a child with it), the model's
`Mxfp4FusedMoE` against the repository's torch path and against the experts dequantized at load, the
layers' execution check and tunings, the mapping against the MXFP4 rule, and the declared launches.

Blocks are random bytes (every e2m1 code), scales random e8m0 exponents around 2^-4; shapes with
tails in every dimension the kernel tiles (H = 96: three K tiles and a partial 64-column block;
I = 32 or 64), routings with an expert that receives no token, top-k 1 and 2, with and without biases,
each activation. fp32 is compared at fp32 rounding (only the summation order and where the scale
multiplies differ); bfloat16 at a few of its ulps (each matmul's output is rounded to bfloat16, as the
reference rounds it)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter

E, H = 4, 96


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


def _mx():
    return importlib.import_module("kernels_local.fused_moe.mxfp4")


def experts(
    inter: int = 64, bias: bool = True, activation: str = "swiglu_oai", dtype=torch.float32, seed: int = 0
):
    """Stand-in for the model's `Mxfp4FusedMoE`: the attributes the kernel layers read."""
    gen = torch.Generator().manual_seed(seed)
    out = SimpleNamespace(activation=activation, alpha=1.702, limit=7.0, row_tile=None, execution="w4a16")
    for name, (n, k) in (("w_gate_up", (2 * inter, H)), ("w_down", (H, inter))):
        setattr(
            out, f"{name}_blocks", torch.randint(0, 256, (E, n, k // 2), generator=gen, dtype=torch.uint8)
        )
        setattr(
            out, f"{name}_scales", torch.randint(120, 126, (E, n, k // 32), generator=gen, dtype=torch.uint8)
        )
    out.b_gate_up = (torch.randn(E, 2 * inter, generator=gen) * 0.1).to(dtype) if bias else None
    out.b_down = (torch.randn(E, H, generator=gen) * 0.1).to(dtype) if bias else None
    return out


def routing(tokens: int, k: int, seed: int = 0):
    """Top-k ids over experts 0, 2 and 3 only (expert 1 gets no token), softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.tensor([0, 2, 3])[torch.randperm(3, generator=gen)[:k]] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "tokens,k,inter,activation", [(1, 1, 32, "swiglu_oai"), (5, 2, 64, "silu"), (3, 2, 32, "gelu_tanh")]
)
@needs_interpreter
def test_the_kernel_matches_its_reference(tokens, k, inter, activation, dtype):
    mx = _mx()
    from kernels_local.fused_moe.fused_moe import HOPPER, PRE_HOPPER, ROCM

    ex = experts(inter, bias=tokens > 1, activation=activation, dtype=dtype, seed=tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(k)).to(dtype)
    ids, weights = routing(tokens, k)
    ref = mx.fused_moe_mxfp4_reference(x, ex, ids, weights)
    for tuning in (PRE_HOPPER, HOPPER, ROCM):
        y = mx.fused_moe_mxfp4(x, ex, ids, weights, tuning=tuning)
        assert y.dtype == dtype and y.shape == (tokens, H)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            y.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max())
        )


@needs_interpreter
def test_every_code_and_the_extreme_scales_decode_exactly():
    """Rows holding the 16 codes in order and blocks scaled by 2^-127 (e8m0 0, fp32's subnormal) and
    2^13: the kernel's decode equals the reference's table (fp32, one token, top-k 1)."""
    mx = _mx()
    from kernels_local.fused_moe.fused_moe import PRE_HOPPER

    ex = experts(64, bias=False, activation="silu", seed=3)
    every = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # codes 0..15
    for name in ("w_gate_up", "w_down"):
        getattr(ex, f"{name}_blocks")[0, :, :8] = every
        getattr(ex, f"{name}_scales")[0, 0::2, 0] = 0
        getattr(ex, f"{name}_scales")[0, 1::2, 1] = 140
    want = mx.dequantize_mxfp4(ex.w_down_blocks[0], ex.w_down_scales[0], torch.float32)
    assert (want[0, :16] / 2.0**-127).tolist() == list(mx.E2M1)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    y = mx.fused_moe_mxfp4(x, ex, ids, weights, tuning=PRE_HOPPER)
    ref = mx.fused_moe_mxfp4_reference(x, ex, ids, weights)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


# -- the model's layer, the layers of the repository, the mapping ----------------------------------


def _model_experts(dtype=torch.float32, seed: int = 5):
    """The model's `Mxfp4FusedMoE`, filled with the stand-in's bytes."""
    from workers.quant.mxfp4_experts import Mxfp4FusedMoE

    ref = experts(64, bias=True, dtype=dtype, seed=seed)
    layer = Mxfp4FusedMoE(E, H, 64, bias=True, activation="swiglu_oai", dtype=dtype, device="cpu")
    with torch.no_grad():
        for name in (
            "w_gate_up_blocks",
            "w_gate_up_scales",
            "w_down_blocks",
            "w_down_scales",
            "b_gate_up",
            "b_down",
        ):
            getattr(layer, name).copy_(getattr(ref, name))
    return layer


@pytest.mark.skipif(INTERPRETED, reason="torch paths only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_models_reference_is_the_repositorys_and_the_dequantized_experts_bit_for_bit(dtype):
    """`Mxfp4FusedMoE.forward` equals every repository layer's path on CPU tensors (what a simulated
    device runs) and `FusedMoE` over the experts dequantized at load, bit for bit."""
    from workers.model.moe import FusedMoE
    from workers.quant.mxfp4 import dequantize

    layers = importlib.import_module("kernels_local.fused_moe.layers")
    layer = _model_experts(dtype)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = routing(7, 2, seed=3)
    want = layer(x, ids, weights)
    for cls in (
        "Mxfp4FusedMoE",
        "Mxfp4FusedMoETritonSm80",
        "Mxfp4FusedMoETritonSm90",
        "Mxfp4FusedMoETritonRocm",
    ):
        assert torch.equal(getattr(layers, cls).forward(layer, x, ids, weights), want), cls
    dense = FusedMoE(E, H, 64, bias=True, activation="swiglu_oai").to(dtype)
    with torch.no_grad():
        for name, (n, k) in (("w_gate_up", (128, H)), ("w_down", (H, 64))):
            blocks = getattr(layer, f"{name}_blocks").view(E, n, k // 32, 16)
            getattr(dense, name).copy_(dequantize(blocks, getattr(layer, f"{name}_scales"), dtype))
        dense.b_gate_up.copy_(layer.b_gate_up)
        dense.b_down.copy_(layer.b_down)
    assert torch.equal(dense(x, ids, weights), want)
    layer.row_tile = dense.row_tile = 4  # deterministic mode: fixed tiles, the same bits again
    assert torch.equal(layers.Mxfp4FusedMoETritonSm90.forward(layer, x, ids, weights), dense(x, ids, weights))


def test_each_layer_refuses_another_execution_and_passes_its_tuning(monkeypatch):
    """Guards the `Mxfp4FusedMoE*` entries of `COMPILE_SPECS` and their forwards: each Triton layer runs
    with the tuning its specs were built with, and every layer refuses a module of another execution."""
    layers = importlib.import_module("kernels_local.fused_moe.layers")
    seen = {}
    monkeypatch.setattr(layers, "fused_moe_mxfp4", lambda *a, **kw: seen.update(tuning=kw["tuning"]))
    names = [n for n in layers.COMPILE_SPECS if n.startswith("Mxfp4FusedMoE")]
    assert sorted(names) == ["Mxfp4FusedMoETritonRocm", "Mxfp4FusedMoETritonSm80", "Mxfp4FusedMoETritonSm90"]
    x, (ids, weights) = torch.ones(2, H), routing(2, 1)
    for name in names:
        module = SimpleNamespace(execution="w4a16", row_tile=None)
        getattr(layers, name).forward(module, x, ids, weights)
        assert seen == {"tuning": layers.COMPILE_SPECS[name].args[0]}, name
    for name in [*names, "Mxfp4FusedMoE"]:
        with pytest.raises(TypeError, match="`w4a16` execution got a module of `dequantized`"):
            getattr(layers, name).forward(SimpleNamespace(execution="dequantized"), x, ids, weights)


def test_the_mapping_gives_every_device_the_execution_of_the_mxfp4_rule():
    """The `Mxfp4FusedMoE` ranges of kernels_local/mapping.py are the contract's `mxfp4_kind` on every
    architecture the preflight claims, on CPU, and beyond the newest."""
    from kernels_local.mapping import select
    from workers.contract import parse_token
    from workers.contract.mxfp4_rule import mxfp4_kind
    from workers.kernelize.arch_limits import PREFLIGHT_ARCHS
    from workers.quant.mxfp4 import mxfp4_execution

    devices = [parse_token(a) for a in PREFLIGHT_ARCHS] + [("cpu", None), ("cuda", (6, 1)), ("cuda", (13, 0))]
    for device_type, cap in devices:
        choice = select(device_type, cap)["Mxfp4FusedMoE"]
        kind = mxfp4_kind(device_type, cap)
        assert choice.variant.split("-")[0] == kind, (device_type, cap, choice.variant)
        assert ("triton" in choice.variant) == (kind == "w4a16")
        assert mxfp4_execution(device_type, cap).kind == kind


def test_the_declared_launches_are_what_the_wrapper_launches(monkeypatch):
    """Guards `mxfp4_compile_specs`: every launch the wrapper makes (per tuning, dtype and token count)
    is one the preflight compiles."""
    from kernels_local.compile_spec import Workload
    from kernels_local.fused_moe.fused_moe import HOPPER, PRE_HOPPER, ROCM

    mx = _mx()
    launched = []

    class Recorder:
        __name__ = "_moe_mxfp4_gemm_kernel"

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw)

    monkeypatch.setattr(mx, "_moe_mxfp4_gemm_kernel", Recorder())
    monkeypatch.setattr(mx, "runs_triton", lambda x: True)
    for tuning in (PRE_HOPPER, HOPPER, ROCM):
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            for tokens in (1, 40):
                launched.clear()
                ex = experts(64, bias=tokens > 1, activation="silu", dtype=dtype)
                ids, weights = routing(tokens, 2)
                mx.fused_moe_mxfp4(torch.ones(tokens, H, dtype=dtype), ex, ids, weights, tuning=tuning)
                specs = mx.mxfp4_compile_specs(tuning, Workload(dtype=name, widths=(64, H), max_tokens=64))
                declared = {(s.constexprs, s.num_warps, s.num_stages) for s in specs}
                assert len(launched) == 2
                for kw in launched:
                    warps, stages = kw.pop("num_warps"), kw.pop("num_stages")
                    assert (tuple(kw.items()), warps, stages) in declared, (tuning.name, name, tokens, kw)


# -- on a real GPU (scripts/gpu_check.sh runs the gpu-marked tests first) ----------------------------


def _device_experts(e, h, i, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = SimpleNamespace(activation="swiglu_oai", alpha=1.702, limit=7.0, row_tile=None, execution="w4a16")
    for name, (n, k) in (("w_gate_up", (2 * i, h)), ("w_down", (h, i))):
        blocks = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        setattr(out, f"{name}_blocks", blocks.cuda())
        setattr(
            out,
            f"{name}_scales",
            torch.randint(118, 124, (e, n, k // 32), generator=gen, dtype=torch.uint8).cuda(),
        )
    out.b_gate_up = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(dtype).cuda()
    out.b_down = (torch.randn(e, h, generator=gen) * 0.1).to(dtype).cuda()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("e,k,h,i", [(32, 4, 2880, 2880), (8, 2, 96, 64)], ids=["gpt-oss-20b", "tiny"])
def test_the_compiled_kernel_matches_the_reference_on_this_gpu(e, k, h, i, tokens):
    """The tuning the mapping gives this GPU, compiled, against the torch reference: bf16 at a few ulps,
    fp32 at fp32 rounding (a tf32 dot would be off by ~1e-3)."""
    from kernels_local.fused_moe.fused_moe import HOPPER, PRE_HOPPER, ROCM
    from kernels_local.mapping import select

    mx = _mx()
    cap = torch.cuda.get_device_capability(0)
    layer = select("rocm" if torch.version.hip else "cuda", cap)["Mxfp4FusedMoE"].layer
    tuning = {"Mxfp4FusedMoETritonSm80": PRE_HOPPER, "Mxfp4FusedMoETritonSm90": HOPPER,
              "Mxfp4FusedMoETritonRocm": ROCM}.get(layer, PRE_HOPPER)  # fmt: skip
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).cuda()
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).cuda()
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        ex = _device_experts(e, h, i, dtype)
        x = torch.randn(tokens, h, generator=gen).to(dtype).cuda()
        y, ref = (
            mx.fused_moe_mxfp4(x, ex, ids, weights, tuning=tuning),
            mx.fused_moe_mxfp4_reference(x, ex, ids, weights),
        )
        torch.testing.assert_close(
            y.float(), ref.float(), rtol=tol, atol=tol * float(ref.float().abs().max())
        )
