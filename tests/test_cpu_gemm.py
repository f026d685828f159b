"""The CPU projection by brgemm over column panels (kernels_local/panel_linear/cpu.py and .cpp): the
layout, the product against torch's and against the oneDNN packs it replaces, which weights it
takes, its errors and its switch.

The C++ source is built on first use (20-30 s once per host, then cached by torch); without a
C++ compiler the tests that need it skip with the reason the loader gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_local.panel_linear import cpu as cpu_gemm
from workers.model.cpu_projections import pack, packing_refusal

DTYPES = [torch.float32, torch.bfloat16]


def _needs_gemm(dtype=torch.float32):
    state = cpu_gemm.load()
    if not state.available:
        pytest.skip(state.reason)
    if packing_refusal(dtype) is not None:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}: {packing_refusal(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_panels_hold_the_transposed_weight_panel_by_panel(dtype):
    """[N, K] -> [K, N] as column panels of `PANEL` (the last narrower), each [K, w] or, in
    bfloat16, [K/2, w, 2]: reading them back panel by panel gives the weight."""
    n, k, step = 2 * cpu_gemm.PANEL + 16, 6, cpu_gemm.PANEL
    weight = torch.arange(n * k, dtype=torch.float32).view(n, k).to(dtype)
    flat, back, at = cpu_gemm.panels(weight).flatten(), [], 0
    for n0 in range(0, n, step):
        w = min(step, n - n0)
        part = flat[at : at + k * w]
        back.append(part.view(k // 2, w, 2).transpose(1, 2).reshape(k, w) if dtype == torch.bfloat16
                    else part.view(k, w))
        at += k * w
    assert torch.equal(torch.cat(back, dim=1), weight.t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 130, 300])
@pytest.mark.parametrize("k, n", [(256, 200), (688, 64)])
def test_the_product_is_torchs_within_rounding_and_the_packs_bit_for_bit_on_short_reductions(dtype, rows, k, n):
    """Against `F.linear` within rounding at every row block (130 rows: three blocks of at most
    64; 300 rows: five, shared among two threads) and a narrower last panel (200 columns); against
    the oneDNN pack it replaces, bit for bit where oneDNN does not split the reduction (K = 256),
    within rounding otherwise."""
    _needs_gemm(dtype)
    g = torch.Generator().manual_seed(rows + k)
    weight = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    for b in (None, bias):
        got = cpu_gemm.linear(x, cpu_gemm.panels(weight), b)
        assert got.shape == (rows, n) and got.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(got, F.linear(x, weight, b), **tol)
        onednn = torch.ops.mkldnn._linear_pointwise(x, pack(weight), b, "none", [], "")
        if k == 256:
            assert torch.equal(got, onednn)
        else:
            torch.testing.assert_close(got, onednn, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompts_rows_shared_among_threads_give_the_same_bits(dtype):
    """From 256 rows (`kParallelBlocks` blocks of 64) the row blocks are split over torch's
    threads: each output element is still one kernel's sum, so 2 threads give exactly what 1
    gives, for row counts that split evenly and not."""
    _needs_gemm(dtype)
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(200, 256, generator=g) * 0.05).to(dtype)
    layout, before = cpu_gemm.panels(weight), torch.get_num_threads()
    try:
        for rows in (256, 257, 700):
            x = torch.randn(rows, 256, generator=g).to(dtype)
            torch.set_num_threads(1)
            one = cpu_gemm.linear(x, layout, None)
            torch.set_num_threads(2)
            assert torch.equal(cpu_gemm.linear(x, layout, None), one), rows
    finally:
        torch.set_num_threads(before)


def test_which_weights_fit_the_layout():
    """Guards `fits`: float32, or bfloat16 with an even K, up to `MAX_K`."""
    assert cpu_gemm.fits(torch.empty(8, cpu_gemm.MAX_K))
    assert not cpu_gemm.fits(torch.empty(8, cpu_gemm.MAX_K + 2))
    assert cpu_gemm.fits(torch.empty(8, 10, dtype=torch.bfloat16))
    assert not cpu_gemm.fits(torch.empty(8, 11, dtype=torch.bfloat16))
    assert not cpu_gemm.fits(torch.empty(8, 10, dtype=torch.float16))


def test_a_layout_of_another_dtype_or_width_is_an_error_naming_both():
    _needs_gemm()
    panels = cpu_gemm.panels(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match=r"float32 rows with a \[K, N\] layout.*got BFloat16 rows"):
        cpu_gemm.linear(torch.randn(3, 32).bfloat16(), panels, None)
    with pytest.raises(RuntimeError, match=r"rows \[3, 31\]"):
        cpu_gemm.linear(torch.randn(3, 31), panels, None)


def test_the_switch_keeps_the_packs_and_says_so(monkeypatch):
    """Guards `load()`'s `$HETSERVE_CPU_GEMM=off` branch: nothing is built, the reason names it."""
    monkeypatch.setenv(cpu_gemm.ENV_CPU_GEMM, "off")
    cpu_gemm.load.cache_clear()
    try:
        state = cpu_gemm.load()
        assert not state.available and "HETSERVE_CPU_GEMM=off" in state.reason
    finally:
        monkeypatch.delenv(cpu_gemm.ENV_CPU_GEMM)
        cpu_gemm.load.cache_clear()
