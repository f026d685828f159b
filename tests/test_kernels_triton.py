"""The RMSNorm, SiluAndMul and fp8 linear Triton kernels against their torch references, on CPU
under `TRITON_INTERPRET=1` (tests/interpreter.py: this file reruns itself in a child with it);
paged attention has its own file (tests/test_kernels_paged_attention.py).

Shapes stay small (the interpreter costs about 1 ms per program instance) and include
widths that are not powers of two, so every masked edge is exercised. fp16 results are
compared exactly where the kernel mirrors the reference's rounding; bf16 uses
`assert_close`'s defaults because the interpreter converts fp32 to bf16 by truncation
where torch rounds to nearest (one bf16 ulp). fp8 operands are put on the e4m3 grid in
torch before the kernel, so the interpreter's inexact fp32 -> fp8 cast never runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from workers.quant.e4m3 import decode_e4m3
from workers.quant.fp8_convention import EMULATED_E4M3, EMULATED_E4M3_FNUZ, NATIVE_E4M3, NATIVE_E4M3_FNUZ
from workers.quant.fp8_quantize import quantize_weight_per_channel


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.fixture(scope="module")
def interp():
    import kernels_local.activation
    import kernels_local.fp8_linear
    import kernels_local.rmsnorm

    mods = {
        "rmsnorm": kernels_local.rmsnorm,
        "activation": kernels_local.activation,
        "fp8_linear": kernels_local.fp8_linear,
    }
    for repo, mod in mods.items():
        assert mod.runs_triton(torch.empty(1)), f"{repo} was not created under the interpreter"
    return mods


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_SHAPES = [(1, 64), (3, 96), (2, 5, 200), (17, 48), (4, 1000)]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual, expected)


# -- RMSNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@needs_interpreter
def test_rms_norm_matches_reference(interp, shape, dtype):
    m = interp["rmsnorm"]
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    ref = m.rms_norm_reference(x, w, 1e-6)
    for tuning in m.TUNINGS.values():
        y = m.rms_norm(x, w, 1e-6, tuning)
        assert y.shape == x.shape and y.dtype == ref.dtype
        if dtype == torch.float16:
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
        else:
            _close(y, ref)


@needs_interpreter
def test_rms_norm_fp32_weight_and_strided_input(interp):
    m = interp["rmsnorm"]
    x = torch.randn(6, 2 * 72, dtype=torch.bfloat16)[:, ::2]  # [6, 72], stride 2 along the row
    w = torch.randn(72)  # fp32 weight: output promotes to fp32, like the reference
    ref = m.rms_norm_reference(x, w, 1e-5)
    y = m.rms_norm(x, w, 1e-5, m.TUNINGS["sm90"])
    assert y.dtype == torch.float32
    # h is rounded to bf16 before the fp32 weight multiply: bf16 tolerance
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-5)


# -- SiluAndMul --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (2, 5, 200), (2, 1500)], ids=str)
@needs_interpreter
def test_silu_and_mul_matches_reference(interp, shape, dtype):
    m = interp["activation"]
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4).to(dtype)
    ref = m.silu_and_mul_reference(x)
    for tuning in m.TUNINGS.values():
        y = m.silu_and_mul(x, tuning)
        assert y.shape == ref.shape and y.dtype == dtype
        _close(y, ref)


@needs_interpreter
def test_silu_and_mul_rejects_odd_width(interp):
    with pytest.raises(ValueError, match="even last dimension, got `7`"):
        interp["activation"].silu_and_mul(torch.randn(2, 7))


# -- fp8 linear ----------------------------------------------------------------------------

CONVENTIONS = {
    "e4m3fn": (NATIVE_E4M3, EMULATED_E4M3),
    "e4m3fnuz": (NATIVE_E4M3_FNUZ, EMULATED_E4M3_FNUZ),
}
GEMM_SHAPES = [(1, 48, 96), (5, 40, 72), (33, 24, 64)]  # (M, N, K): tails in every dim


def _quantized_weight(n: int, k: int, fmt: str, seed: int):
    native, emulated = CONVENTIONS[fmt]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q_native, scale = quantize_weight_per_channel(w, native)
    q_emulated, scale_e = quantize_weight_per_channel(w, emulated)
    assert torch.equal(q_native.view(torch.uint8), q_emulated) and torch.equal(scale, scale_e)
    return q_native, q_emulated, scale


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk", GEMM_SHAPES, ids=str)
@needs_interpreter
def test_fp8_linear_native_and_emulated_match_reference(interp, mnk, dtype, fmt):
    m = interp["fp8_linear"]
    rows, n, k = mnk
    q_native, q_emulated, scale = _quantized_weight(n, k, fmt, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    bias = torch.randn(n).to(dtype) if rows % 2 else None
    ref = m.fp8_linear_reference(x, q_emulated, scale, bias, fmt)
    for tuning in m.TUNINGS.values():
        y_native = m.fp8_linear(x, q_native, scale, bias, native=True, fmt=fmt, tuning=tuning)
        y_emulated = m.fp8_linear(x, q_emulated, scale, bias, native=False, fmt=fmt, tuning=tuning)
        # same grid values, exact products, same tile order: the two flags give the same bits
        assert torch.equal(y_native, y_emulated), tuning.name
        _close(y_native, ref)


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@needs_interpreter
def test_fp8_decode_covers_every_byte(interp, fmt):
    """All finite e4m3 bytes (subnormals, max, both signs) through the emulated kernel's
    in-register decode: one-hot tokens read out each weight column."""
    m = interp["fp8_linear"]
    nan_bytes = {0x7F, 0xFF} if fmt == "e4m3fn" else {0x80}
    codes = torch.tensor(
        [b for b in range(256) if b not in nan_bytes] + [0] * len(nan_bytes), dtype=torch.uint8
    )
    q = codes.reshape(16, 16)  # [N, K]
    scale = torch.ones(16)
    x = torch.eye(16)  # token j is on the grid as `max` with scale 1/max: y[j, n] = max * w[n, j] / max
    y = m.fp8_linear(x, q, scale, None, native=False, fmt=fmt, tuning=m.TUNINGS["sm80"])
    max_value = CONVENTIONS[fmt][0].max_value
    x_scale = torch.ones(1) / max_value  # what the kernel's epilogue multiplies by
    expected = (decode_e4m3(q, fmt).t() * max_value) * x_scale
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    y_native = m.fp8_linear(x, q.view(CONVENTIONS[fmt][0].fp8_dtype), scale, None, native=True, fmt=fmt)
    assert torch.equal(y_native, y)


@needs_interpreter
def test_fp8_linear_refuses_a_buffer_of_the_other_convention(interp):
    m = interp["fp8_linear"]
    q_native, q_emulated, scale = _quantized_weight(16, 32, "e4m3fn", seed=0)
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="buffer and kernel flag must come from the same convention"):
        m.fp8_linear(x, q_emulated, scale, None, native=True, fmt="e4m3fn")
    with pytest.raises(TypeError, match="dtype `torch.float8_e4m3fn`"):
        m.fp8_linear(x, q_native, scale, None, native=False, fmt="e4m3fn")


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@needs_interpreter
def test_fused_per_token_quantization_matches_the_torch_quantizer(interp, fmt):
    """The GPU path's one-kernel quantizer against `quantize_rows`, bit for bit: exact ties
    (round half to even), subnormals, the saturation point, zero rows, fp8 and fp16 outputs."""
    quant = interp["fp8_linear"].quant
    native = CONVENTIONS[fmt][0]
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), fmt)
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
    ties = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([grid, ties, -ties])  # amax is the format's max: scale 1, x / scale == x
    rows = torch.stack([row, row * 3.7, torch.zeros_like(row), torch.randn(row.numel()) * 1e-3])
    rows = torch.cat([rows, torch.zeros(4, 3)], dim=1)  # width not a power of two
    want_grid, want_scale = quant.quantize_rows(rows, fmt)
    for out_dtype in (native.fp8_dtype, torch.float16):
        q, scale = quant.quantize_rows_triton(rows, fmt, out_dtype)
        assert q.dtype == out_dtype and torch.equal(scale, want_scale)
        assert torch.equal(q.to(torch.float32), want_grid)
