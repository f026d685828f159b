"""The local kernel repositories: `kernels` layout, stateless layers, tunings, and the torch
paths (CPU) against the host's references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kernels import LocalLayerRepository
from kernels.layer.layer import _validate_layer

from kernels_local import activation, fp8_linear, rmsnorm
from workers.model.layers import PagedAttention as ModelPagedAttention
from workers.model.layers import RMSNorm as ModelRMSNorm
from workers.model.layers import SiluAndMul as ModelSiluAndMul
from workers.quant.e4m3 import decode_e4m3, round_to_e4m3
from workers.quant.fp8_convention import EMULATED_E4M3, EMULATED_E4M3_FNUZ, NATIVE_E4M3, choose_fp8
from workers.quant.fp8_quantize import dequantize, quantize, quantize_weight_per_channel

REPOS = Path(__file__).resolve().parents[1] / "kernels_local"
REPO_LAYERS = {
    "rmsnorm": ["RMSNorm", "RMSNormTritonSm70", "RMSNormTritonSm90", "RMSNormTritonRocm"],
    "activation": ["SiluAndMul", "SiluAndMulTritonSm70", "SiluAndMulTritonSm90", "SiluAndMulTritonRocm"],
    "fp8_linear": [
        "Fp8Linear",
        "Fp8LinearTritonEmulatedSm80",
        "Fp8LinearTritonNativeSm89",
        "Fp8LinearTritonNativeSm90",
        "Fp8LinearTritonEmulatedRocm",
        "Fp8LinearTritonNativeRocm",
    ],
    "paged_attention": ["PagedAttention", "PagedAttentionTritonSm70", "PagedAttentionTritonSm90",
                        "PagedAttentionTritonRocm"],
    "fused_moe": ["FusedMoE", "FusedMoETritonSm70", "FusedMoETritonSm90", "FusedMoETritonRocm"],
    "gguf_linear": ["GGUFLinear", "GGUFLinearTritonSm70", "GGUFLinearTritonSm80", "GGUFLinearTritonSm90",
                    "GGUFLinearTritonRocm"],
    # CPU kernels the worker calls directly; their layers keep each repository loadable through `kernels`
    "rotary": ["Rotary", "RotaryCpu"],
    "panel_linear": ["Linear", "PanelLinearCpu"],
    "sampling": ["GreedyRows", "GreedyRowsCpu"],
    "lora_sgmv": ["LoraDelta", "LoraDeltaTritonSm70", "LoraDeltaTritonSm90", "LoraDeltaTritonRocm"],
}


@pytest.mark.parametrize("repo", sorted(REPO_LAYERS))
def test_metadata_follows_the_kernels_layout(repo):
    meta = json.loads((REPOS / repo / "metadata.json").read_text())
    assert set(meta) == {"id", "name", "version", "license", "python-depends", "backend"}
    assert meta["name"] == meta["name"].lower() and "_" not in meta["name"]
    assert meta["python-depends"] == [] and meta["backend"] == {"type": "cpu"}


@pytest.mark.parametrize("repo", sorted(REPO_LAYERS))
def test_layers_load_and_are_stateless(repo):
    """`kernels` refuses layers with a constructor or extra members; check every layer the
    way it does, against the model layer it replaces."""
    from workers.lora.apply import LoraDelta as ModelLoraDelta
    from workers.model.moe import FusedMoE as ModelFusedMoE
    from workers.quant.quantize_model import Fp8Linear as ModelFp8Linear

    # no model module applies the rotary, picks greedy rows or holds GGUF blocks yet: their layers keep the
    # reference's forward
    own = {r: LocalLayerRepository(repo_path=REPOS / r, layer_name=REPO_LAYERS[r][0]).load()
           for r in ("rotary", "sampling", "gguf_linear")}  # fmt: skip
    replaced = {"rmsnorm": ModelRMSNorm, "activation": ModelSiluAndMul, "fp8_linear": ModelFp8Linear,
                "paged_attention": ModelPagedAttention, "fused_moe": ModelFusedMoE, "panel_linear": torch.nn.Linear,
                "lora_sgmv": ModelLoraDelta, **own}[repo]
    for name in REPO_LAYERS[repo]:
        lrepo = LocalLayerRepository(repo_path=REPOS / repo, layer_name=name)
        cls = lrepo.load()
        _validate_layer(check_cls=replaced, cls=cls, repo=lrepo)
        assert cls.__init__ is torch.nn.Module.__init__


def _layer(repo: str, name: str) -> torch.nn.Module:
    return LocalLayerRepository(repo_path=REPOS / repo, layer_name=name).load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_rotary_repository_is_the_models_rotary(dtype):
    """kernels_local/rotary: its reference is `apply_rotary`'s torch form, and its CPU layer (the C++
    kernel where it builds) gives the same bits, full and partial rotary."""
    from workers.model.rope import apply_rotary

    g = torch.Generator().manual_seed(4)
    for rot in (32, 16):
        x = torch.randn(5, 3, 32, generator=g).to(dtype)  # [T, heads, D]
        cos, sin = (torch.randn(5, 1, rot // 2, generator=g).to(dtype) for _ in range(2))
        want = apply_rotary(x[None], cos, sin)[0]  # batched: the torch form
        assert torch.equal(_layer("rotary", "Rotary")().forward(x, cos, sin), want)
        assert torch.equal(_layer("rotary", "RotaryCpu")().forward(x, cos, sin), want)


def test_the_sampling_repository_is_the_samplers_greedy_rows():
    """kernels_local/sampling: its reference and its CPU layer pick the sampler's greedy tokens and
    logprobs (log_softmax, argmax, gather), the first of equal logits."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = logprobs.argmax(dim=-1)
    for name in ("GreedyRows", "GreedyRowsCpu"):
        got_ids, got_lps = _layer("sampling", name)().forward(logits)
        assert got_ids.tolist() == ids.tolist() and got_ids[2] == 7
        assert torch.equal(got_lps, logprobs.gather(1, ids[:, None])[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_panel_linear_repository_is_a_linear(dtype):
    """kernels_local/panel_linear: its layers replace `nn.Linear`'s forward; the CPU layer multiplies
    through the panels kept on the weight (or `F.linear` without them), within the last bit."""
    from kernels_local.panel_linear import cpu
    from workers.model.cpu_projections import panels_fit

    linear = torch.nn.Linear(64, 96).to(dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    want = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert torch.equal(_layer("panel_linear", "Linear").forward(linear, x), want)
    panel = _layer("panel_linear", "PanelLinearCpu")
    assert torch.equal(panel.forward(linear, x), want)  # no panels on the weight: F.linear
    if cpu.load().available and panels_fit(linear.weight):  # bfloat16 panels need AMX (a worker packs them otherwise)
        setattr(linear.weight, cpu.PACKED_ATTR, cpu.panels(linear.weight))
        torch.testing.assert_close(panel.forward(linear, x), want)


def test_rms_norm_tunings_really_differ():
    t = rmsnorm.TUNINGS
    # a narrow row: pre-Hopper runs one row per program, Hopper packs several
    assert t["sm70"].launch_shape(256)[0] == 1 and t["sm90"].launch_shape(256)[0] == 8
    # a wide row: Hopper spreads it over more warps; ROCm's 64-lane wavefronts need fewer
    assert t["sm90"].launch_shape(8192)[1] == 16
    assert t["sm70"].launch_shape(8192)[1] == 8
    assert t["rocm"].launch_shape(8192)[1] == 8
    assert t["rocm"].launch_shape(1024)[0] == 2


def test_silu_and_mul_tunings_really_differ():
    t = activation.TUNINGS
    assert t["sm90"].launch_shape(14336) == (4096, 8)
    assert t["sm70"].launch_shape(14336) == (1024, 4)
    assert t["rocm"].launch_shape(14336) == (2048, 4)
    assert t["sm70"].launch_shape(48) == (64, 1)  # narrow rows shrink the block


def test_fp8_gemm_tunings_really_differ():
    t = fp8_linear.TUNINGS
    assert t["sm90"].launch_shape(512)[:3] == (128, 128, 128) and t["sm90"].num_stages == 4
    assert t["sm89"].launch_shape(512)[:3] == (64, 64, 128) and t["sm89"].num_stages == 3
    assert t["sm80"].launch_shape(1)[:3] == (16, 64, 64)  # decode: the smallest M tile tl.dot takes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_paths_equal_the_model_references(dtype):
    """On CPU tensors (no interpreter) the Triton launchers run the torch reference, which is
    the model's own math bit for bit."""
    norm = ModelRMSNorm(40, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 7, 40).to(dtype)
    for tuning in rmsnorm.TUNINGS.values():
        assert torch.equal(rmsnorm.rms_norm(x, norm.weight, norm.variance_epsilon, tuning), norm(x))
    act = ModelSiluAndMul()
    x2 = torch.randn(3, 7, 80).to(dtype)
    for tuning in activation.TUNINGS.values():
        assert torch.equal(activation.silu_and_mul(x2, tuning), act(x2))


# -- e4m3 arithmetic: the repository's copy agrees with the host's quantizer ----------------


def _edge_values() -> torch.Tensor:
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), "e4m3fn")
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2  # exact ties between neighbours (round half to even)
    rnd = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100
    return torch.cat([grid, mids, -mids, rnd, torch.tensor([0.0, -0.0, 1e-12, 500.0, -1e6, 2.0**-10])])


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_round_to_grid_equals_the_host_rounding(fmt):
    x = _edge_values()
    ours, host = fp8_linear.round_to_grid(x, fmt), round_to_e4m3(x, fmt)
    assert torch.equal(ours.view(torch.int32), host.view(torch.int32))  # bits, incl. signed zeros


@pytest.mark.parametrize("conv", [NATIVE_E4M3, EMULATED_E4M3_FNUZ], ids=lambda c: c.fmt)
def test_per_token_quantization_equals_the_host_quantizer(conv):
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 9)[:, None]
    grid, scale = fp8_linear.quantize_rows(x, conv.fmt)
    q, host_scale = quantize(x, conv, group_size=48)
    assert torch.equal(scale, host_scale)  # [9, 1]
    assert torch.equal(grid, dequantize(q, torch.ones(()), conv))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_decode_equals_the_host_decode(fmt):
    b = torch.arange(256, dtype=torch.uint8)
    ours, host = fp8_linear.decode(b, fmt), decode_e4m3(b, fmt)
    finite = torch.isfinite(host)
    assert torch.equal(ours[finite], host[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_mm_on_cpu_equals_the_emulated_reference_bit_for_bit(dtype):
    """The native path on CPU (`torch._scaled_mm`) and the emulated reference dequantize both
    operands and multiply in fp32 in the same order: identical bits."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    qn, scale = quantize_weight_per_channel(w, NATIVE_E4M3)
    qe, _ = quantize_weight_per_channel(w, EMULATED_E4M3)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(24).to(dtype)
    native = fp8_linear.fp8_linear(x, qn, scale, bias, native=True, fmt="e4m3fn")
    emulated = fp8_linear.fp8_linear(x, qe, scale, bias, native=False, fmt="e4m3fn")
    assert native.shape == (2, 5, 24) and native.dtype == dtype
    assert torch.equal(native, emulated)


@pytest.mark.gpu
def test_chosen_kernels_on_this_gpu_match_the_references():
    """On a real GPU: the variants `select()` picks for it, compiled, against the references."""
    from kernels_local.mapping import select

    cap = torch.cuda.get_device_capability(0)
    kind = "rocm" if torch.version.hip else "cuda"
    chosen = {k: v.repository().load() for k, v in select(kind, cap).items()}
    norm = ModelRMSNorm(4096).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(chosen["RMSNorm"].forward(norm, x), norm(x))
    act = ModelSiluAndMul()
    x2 = torch.randn(5, 2 * 11008, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(chosen["SiluAndMul"].forward(act, x2), act(x2))
    if kind == "cuda" and cap >= (8, 0):
        from workers.quant.quantize_model import Fp8Linear

        conv = choose_fp8(kind, cap)[0]
        linear = torch.nn.Linear(4096, 1000, bias=True, device="cuda", dtype=torch.bfloat16)
        layer = Fp8Linear.from_linear(linear, conv)
        x3 = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(chosen["Fp8Linear"].forward(layer, x3), layer(x3), rtol=2e-2, atol=2e-2)
    from workers.kv.batch import ForwardBatch, SeqChunk

    kv = torch.randn(2, 8, 64, 16, 128, device="cuda", dtype=torch.bfloat16)  # [K|V, Hkv, NB, B, D]
    lens = [1, 15, 16, 17, 200, 333]
    per = [-(-n // 16) for n in lens]
    ids = torch.randperm(64).tolist()  # scattered blocks, none shared
    tables = [ids[sum(per[:i]) : sum(per[: i + 1])] for i in range(len(lens))]
    decode = ForwardBatch.build([(SeqChunk(n - 1, 1, t), [0]) for n, t in zip(lens, tables, strict=True)], 16,
                                "cuda").decode
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    attn = ModelPagedAttention()
    torch.testing.assert_close(chosen["PagedAttention"].forward(attn, q, kv, decode), attn(q, kv, decode),
                               rtol=2e-2, atol=2e-2)
