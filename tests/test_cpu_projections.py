"""The CPU's projections through oneDNN packs (workers/model/cpu_projections.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workers.model import cpu_projections
from workers.model.cpu_projections import (
    MIN_PACKED_ELEMENTS,
    PACKED_ATTR,
    install_cpu_projections,
    pack,
    packing_refusal,
)


def needs_packing(dtype: torch.dtype) -> None:
    """Skip where this CPU's oneDNN cannot pack `dtype` (bfloat16 on an AVX2-only CPU)."""
    if packing_refusal(dtype) is not None:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}: {packing_refusal(dtype)}")


class Tiny(nn.Module):
    """A large projection (packed), a small one (left to torch) and a stacked expert layer."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = nn.Linear(256, 1024, bias=True, dtype=dtype)  # 2^18 elements: packed
        self.small = nn.Linear(256, 8, bias=False, dtype=dtype)  # a router's size: torch's matmul
        self.experts = nn.Module()
        self.experts.w_gate_up = nn.Parameter(torch.randn(4, 1024, 256, generator=g).to(dtype), requires_grad=False)
        self.experts.w_down = nn.Parameter(torch.randn(4, 256, 512, generator=g).to(dtype), requires_grad=False)
        with torch.no_grad():
            for layer in (self.big, self.small):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.05)
        if self.big.bias is not None:
            with torch.no_grad():
                self.big.bias.copy_(torch.randn(1024, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packs_the_large_projections_and_the_experts_and_says_so(dtype):
    needs_packing(dtype)
    model = Tiny(dtype)
    done = install_cpu_projections(model, "cpu", dtype)
    assert hasattr(model.big.weight, PACKED_ATTR) and not hasattr(model.small.weight, PACKED_ATTR)
    assert len(getattr(model.experts.w_gate_up, PACKED_ATTR)) == 4 and hasattr(model.experts.w_down, PACKED_ATTR)
    assert (done.layers, done.packed) == (2, 3)
    size = torch.finfo(dtype).bits // 8
    assert done.packed_bytes == (1024 * 256 + 4 * 1024 * 256 + 4 * 256 * 512) * size
    assert "packed weights (1 projections, 2 expert stacks" in done.reason
    from kernels_local.panel_linear import cpu as cpu_gemm

    if cpu_gemm.load().available:  # every K here is at most MAX_K: all three laid out as panels
        assert "3 as brgemm column panels" in done.reason and cpu_gemm.is_panels(getattr(model.big.weight, PACKED_ATTR))
    assert model.small.weight.numel() < MIN_PACKED_ELEMENTS <= model.big.weight.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_a_packed_projection_is_torchs_within_rounding_for_every_row_count(dtype, rows):
    """Rows up to 16 go as they are, more are padded to their bucket (17 -> 24, 40 -> 48) and cut back."""
    model = Tiny(dtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    want_big, want_small = F.linear(x, model.big.weight, model.big.bias), F.linear(x, model.small.weight)
    install_cpu_projections(model, "cpu", dtype)
    got = model.big(x)
    assert got.shape == (rows, 1024) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got, want_big, **tol)
    torch.testing.assert_close(model.small(x), want_small, **tol)
    three = model.big(x.reshape(1, rows, 256))  # [B, S, K] as the model's layers call it
    assert torch.equal(three.reshape(rows, 1024), got)


@pytest.mark.parametrize("panels", [False, True], ids=["onednn", "panels"])
def test_the_forward_multiplies_through_the_pack(monkeypatch, panels):
    """Guards `_packed_forward` / `_panel_forward`: a pack of other weights changes the projection's
    result (it reads the pack, not the dense weight), in eager and inside a compiled graph
    (`hetserve::packed_linear`); a lone float32 row reads a oneDNN pack's dense weight (the GEMV
    branch) and a panel layout's panels."""
    from kernels_local.panel_linear import cpu as cpu_gemm
    from kernels_local.panel_linear.cpu import CpuGemm

    if panels and not cpu_gemm.load().available:
        pytest.skip(cpu_gemm.load().reason)
    if not panels:
        monkeypatch.setattr(cpu_projections.cpu_gemm, "load", lambda: CpuGemm(False, "oneDNN packs"))
    model = Tiny(torch.float32)
    install_cpu_projections(model, "cpu", torch.float32)
    assert cpu_gemm.is_panels(getattr(model.big.weight, PACKED_ATTR)) == panels
    other = cpu_gemm.panels if panels else pack
    x = torch.randn(5, 256)
    with torch.no_grad():  # as a worker steps
        right = model.big(x)
        compiled = torch.compile(lambda t: model.big(t) * 2, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), right * 2)
        one = x[:1]
        alone = model.big(one)
        setattr(model.big.weight, PACKED_ATTR, other(torch.randn(1024, 256)))
        assert not torch.allclose(model.big(x), right)
        assert not torch.allclose(compiled(x), right * 2)
        assert torch.equal(model.big(one), F.linear(one, model.big.weight, model.big.bias)) != panels
        assert panels or torch.equal(alone, model.big(one))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompts_bfloat16_rows_take_onednns_matmul_on_the_dense_weight(dtype):
    """Guards `n >= LARGE_ROWS and rows.dtype == torch.bfloat16` in `packed_linear_eager`: from
    `LARGE_ROWS` bfloat16 rows a panel-laid weight's projection is `F.linear` on the dense weight
    (its rows padded to a multiple of `LARGE_ROW_STEP` and cut back), so a pack of other weights no
    longer changes it; fewer rows, and float32 at any count, still read the panels."""
    from kernels_local.panel_linear import cpu as cpu_gemm

    if not cpu_gemm.load().available:
        pytest.skip(cpu_gemm.load().reason)
    needs_packing(dtype)
    model = Tiny(dtype)
    install_cpu_projections(model, "cpu", dtype)
    assert cpu_gemm.is_panels(getattr(model.big.weight, PACKED_ATTR))
    setattr(model.big.weight, PACKED_ATTR, cpu_gemm.panels(torch.randn(1024, 256).to(dtype)))  # other weights
    g = torch.Generator().manual_seed(1)
    large = cpu_projections.LARGE_ROWS + 3  # not a multiple of the step: padded, then cut back
    with torch.no_grad():
        for rows in (large - 4, large):
            x = torch.randn(rows, 256, generator=g).to(dtype)
            got = model.big(x)
            assert got.shape == (rows, 1024)
            dense = torch.equal(got, F.linear(x, model.big.weight, model.big.bias))
            assert dense == (rows >= cpu_projections.LARGE_ROWS and dtype == torch.bfloat16), (rows, dtype)


def test_packing_is_skipped_when_it_would_take_half_the_available_memory(monkeypatch):
    model = Tiny(torch.float32)
    monkeypatch.setattr(cpu_projections, "available_bytes", lambda: 1_000_000)
    done = install_cpu_projections(model, "cpu", torch.float32)
    assert done.packed == 0 and not hasattr(model.big.weight, PACKED_ATTR)
    assert done.reason == f"not packed: the packs would take {(1024 * 256 + 4 * 1024 * 256 + 4 * 256 * 512) * 4} " \
                          "bytes, over 50% of the 1000000 available"
    x = torch.randn(20, 256)
    torch.testing.assert_close(model.big(x), F.linear(x, model.big.weight, model.big.bias))


def test_float16_pads_rows_without_packing_and_other_devices_are_left_alone():
    model = Tiny(torch.float16)
    done = install_cpu_projections(model, "cpu", torch.float16)
    assert done.packed == 0 and done.layers == 2 and "float16" in done.reason
    assert not hasattr(model.big.weight, PACKED_ATTR)
    other = Tiny(torch.float32)
    assert install_cpu_projections(other, "cuda:0", torch.float32).layers == 0
    assert "forward" not in vars(other.big)  # the module's own forward, untouched


def test_a_dtype_this_cpu_cannot_pack_pads_rows_and_says_why(monkeypatch):
    """Guards the `packing_refusal` branch of `install_cpu_projections`: on a CPU whose oneDNN
    refuses to pack bfloat16 (AVX2 only: "bf16 path needs the cpu support avx_ne_convert or
    avx512bw, avx512vl and avx512dq"), a worker would otherwise fail to start at its first pack."""
    message = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw"
    monkeypatch.setattr(cpu_projections, "packing_refusal", lambda dtype: message)
    monkeypatch.setattr(cpu_projections, "pack", lambda w: pytest.fail("packed a weight this CPU cannot pack"))
    model = Tiny(torch.bfloat16)
    done = install_cpu_projections(model, "cpu", torch.bfloat16)
    assert (done.layers, done.packed) == (2, 0) and not hasattr(model.big.weight, PACKED_ATTR)
    assert done.reason == f"bfloat16: rows padded to buckets, weights not packed (this CPU's oneDNN: {message})"
    x = torch.randn(20, 256).to(torch.bfloat16)
    torch.testing.assert_close(model.big(x), F.linear(x, model.big.weight, model.big.bias))


def test_the_probe_reports_what_this_cpu_can_pack():
    """`packing_refusal` is None exactly where a pack of that dtype succeeds (float32 everywhere)."""
    assert packing_refusal(torch.float32) is None
    try:
        pack(torch.zeros(16, 16, dtype=torch.bfloat16))
        packs = True
    except RuntimeError:
        packs = False
    assert (packing_refusal(torch.bfloat16) is None) == packs


def test_packing_experts_builds_their_cpp_loop_at_start(monkeypatch):
    """Guards `install_cpu_projections`' `if experts:` branch: a model with packed experts loads
    the experts' C++ loop while the worker starts (its first build takes 20-30 s), one without
    experts does not."""
    from kernels_local.fused_moe import cpu_experts

    calls = []
    monkeypatch.setattr(cpu_experts, "load", lambda: calls.append(1))
    install_cpu_projections(Tiny(torch.float32), "cpu", torch.float32)
    assert calls == [1]
    plain = Tiny(torch.float32)
    del plain.experts
    install_cpu_projections(plain, "cpu", torch.float32)
    assert calls == [1]
