"""fp8 convention: the choice, the process lock, and exact e4m3 rounding on both paths."""

from __future__ import annotations

import pytest
import torch

from tests.process_state import locked_fp8, unlock_fp8
from workers.contract import NATIVE_FP8_CAPABILITY
from workers.quant.e4m3 import decode_e4m3, encode_e4m3, round_to_e4m3
from workers.quant.fp8_convention import (
    EMULATED_E4M3,
    EMULATED_E4M3_FNUZ,
    NATIVE_E4M3,
    NATIVE_E4M3_FNUZ,
    MixedFp8ConventionError,
    choose_fp8,
    lock_convention,
)
from workers.quant.fp8_quantize import dequantize, quantize, quantize_weight_per_channel


@pytest.fixture(autouse=True)
def _fresh_lock():
    unlock_fp8()
    yield
    unlock_fp8()


@pytest.mark.parametrize(
    "cap,expected",
    [((7, 0), "emulated"), ((7, 5), "emulated"), ((8, 0), "emulated"), ((8, 6), "emulated"),
     ((8, 9), "native_e4m3"), ((9, 0), "native_e4m3"), ((10, 0), "native_e4m3"), ((12, 0), "native_e4m3")],
)
def test_cuda_choice_threshold(cap, expected):
    conv, reason = choose_fp8("cuda", cap)
    assert conv.name == expected
    assert f"{cap[0]}.{cap[1]}" in reason
    assert conv.native == (cap >= NATIVE_FP8_CAPABILITY)


def test_rocm_uses_fnuz_and_cpu_is_emulated():
    conv, reason = choose_fp8("rocm", (9, 4))
    assert conv.native and conv.fp8_dtype == torch.float8_e4m3fnuz and conv.max_value == 240.0
    old, _ = choose_fp8("rocm", (9, 0))
    assert not old.native and old.storage_dtype == torch.uint8 and old.fmt == "e4m3fnuz"
    cpu, reason = choose_fp8("cpu", None)
    assert cpu == EMULATED_E4M3 and "CPU" in reason
    with pytest.raises(ValueError, match="^Unsupported device type `tpu`. Supported: cuda, rocm, cpu$"):
        choose_fp8("tpu", None)


def test_buffer_dtype_and_kernel_flag_come_from_one_value():
    for cap in [(8, 0), (8, 9), (9, 0)]:
        conv, _ = choose_fp8("cuda", cap)
        q, _ = quantize(torch.randn(4, 32), conv)
        # The host buffer dtype is exactly what the kernel flag implies.
        assert (q.dtype == torch.float8_e4m3fn) == conv.native
        assert (q.dtype == torch.uint8) == (not conv.native)
        assert q.dtype == conv.storage_dtype


def test_lock_refuses_a_second_convention():
    """Guards `elif _locked != conv: raise MixedFp8ConventionError` in `lock_convention`:
    without it a process silently mixes native and emulated buffers."""
    assert lock_convention(NATIVE_E4M3) is NATIVE_E4M3
    assert lock_convention(NATIVE_E4M3) is NATIVE_E4M3  # the same one again is fine
    with pytest.raises(MixedFp8ConventionError,
                       match="native_e4m3.*refusing `emulated`.*One process serves one device with one convention\\.$"):
        lock_convention(EMULATED_E4M3)
    assert locked_fp8() is NATIVE_E4M3


def test_native_and_emulated_bytes_identical_and_equal_torch_rne():
    """2**22 samples over [-448, 448]: both paths give identical bytes, equal to torch's
    round-to-nearest-even cast of the raw fp32 values."""
    g = torch.Generator().manual_seed(1234)
    x = (torch.rand(1 << 22, generator=g) * 2 - 1) * 448
    # include exact ties, subnormals, zeros and the extremes
    x[:8] = torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 1.0625, 17.0])
    grid = round_to_e4m3(x)
    native = grid.to(torch.float8_e4m3fn).view(torch.uint8)
    emulated = encode_e4m3(grid)
    reference = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(native, emulated)
    assert torch.equal(native, reference)
    assert torch.equal(decode_e4m3(emulated), grid)


def test_fnuz_grid_matches_torch():
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(1 << 18, generator=g) * 2 - 1) * 240
    grid = round_to_e4m3(x, "e4m3fnuz")
    assert torch.equal(encode_e4m3(grid, "e4m3fnuz"), x.to(torch.float8_e4m3fnuz).view(torch.uint8))


def test_rounding_happens_in_fp32_before_any_downcast():
    """Guards `x32 = x.to(torch.float32)` in `quantize`: dividing an fp16 tensor by the fp32
    0-d scale in fp16 rounds once to fp16 and again to e4m3 (double rounding), which moves about
    0.4% of values one ULP toward zero and makes emulated and native paths disagree."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1 << 16, generator=g) * 3).to(torch.float16)
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, scale = quantize(x, conv)
        expected = round_to_e4m3(x.to(torch.float32) / scale)
        got = q.to(torch.float32) if conv.native else decode_e4m3(q)
        assert torch.equal(got, expected)
    # The failure this prevents exists: fp32 -> fp16 -> e4m3 differs from fp32 -> e4m3.
    y = (torch.rand(1 << 16, generator=g) * 2 - 1) * 448
    assert not torch.equal(y.half().float().to(torch.float8_e4m3fn).view(torch.uint8),
                           y.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("group_size", [None, 16])
def test_quantize_roundtrip_per_tensor_and_per_group(group_size):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g, dtype=torch.float32)
    outs = []
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, scale = quantize(x, conv, group_size=group_size)
        assert scale.shape == (() if group_size is None else (6, 64 // group_size))
        y = dequantize(q, scale, conv, dtype=torch.float32, group_size=group_size)
        # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values
        torch.testing.assert_close(y, x, rtol=2**-4, atol=scale.max().item() * 2.0**-9)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def test_per_channel_weight_scales():
    w = torch.randn(8, 32) * torch.arange(1, 9).unsqueeze(1)
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, scale = quantize_weight_per_channel(w, conv)
        assert q.shape == w.shape and scale.shape == (8,)
        torch.testing.assert_close(dequantize(q, scale, conv), w, rtol=2**-4, atol=1e-3)


def test_bad_group_size_is_named():
    with pytest.raises(ValueError, match="`group_size=5`"):
        quantize(torch.randn(2, 16), NATIVE_E4M3, group_size=5)


def test_weights_are_rounded_onto_the_grid_in_fp32_not_through_float16():
    """Guards `w32 = w.to(torch.float32)` and the fp32 division in `grid = round_to_e4m3(w32 /
    scale.unsqueeze(1), conv.fmt)` in `quantize_weight_per_channel`: a weight downcast to float16
    before the e4m3 rounding (of the weight itself or of weight / scale) is rounded twice.

    Each row's amax is 448, so its scale is exactly 1 and weight / scale is the weight. The other
    values sit 2**-12 (2**-8 near 17) off the midpoint between two e4m3 neighbours: rounded once in
    fp32 they go to the nearer neighbour; float16 (spacing 2**-10 near 1) first rounds them onto
    the midpoint, whose tie then goes to the even neighbour, the other one."""
    crafted = torch.tensor([1.0625 + 2**-12, 1.1875 - 2**-12, 17.0 + 2**-8, -(1.0625 + 2**-12)])
    once = torch.tensor([1.125, 1.125, 18.0, -1.125])  # the nearer neighbour
    twice = torch.tensor([1.0, 1.25, 16.0, -1.0])  # where fp32 -> float16 -> e4m3 lands
    assert torch.equal(round_to_e4m3(crafted.half().float()), twice)  # the hazard is real
    w = torch.cat([torch.tensor([448.0]), crafted]).repeat(2, 1)  # [out=2, in=5]
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, scale = quantize_weight_per_channel(w, conv)
        assert torch.equal(scale, torch.ones(2))
        got = q.to(torch.float32) if conv.native else decode_e4m3(q)
        assert torch.equal(got[:, 1:], once.repeat(2, 1)), conv.name
        # ... and equal to torch's own (single) round-to-nearest-even cast of the fp32 weight
        assert torch.equal(got, w.to(torch.float8_e4m3fn).to(torch.float32)), conv.name


def test_the_reason_names_the_capability_the_threshold_and_the_storage():
    """The fp8 `reason` that `/workers`, `hetserve plan` and the worker's log show."""
    assert choose_fp8("cuda", (8, 0))[1] == (
        "capability 8.0 < 8.9: no fp8 tensor cores, e4m3 bytes stored as uint8 and dequantized for the matmul"
    )
    assert choose_fp8("cuda", "sm_90")[1] == (
        "capability 9.0 >= 8.9: fp8 tensor cores, e4m3fn storage and native fp8 matmul"
    )
    assert choose_fp8("cuda", None)[1].startswith("capability none < 8.9: ")
    assert choose_fp8("rocm", (9, 4))[1] == (
        "ROCm arch 9.4 (CDNA3): fp8 matrix cores on the FNUZ encoding, float8_e4m3fnuz storage"
    )
    assert choose_fp8("rocm", (9, 5))[1] == (
        "ROCm arch 9.5 (CDNA4+): fp8 matrix cores on the OCP encoding, float8_e4m3fn storage"
    )
    assert choose_fp8("rocm", (9, 0))[1] == (
        "ROCm arch 9.0: no fp8 matrix cores, e4m3fnuz bytes stored as uint8 and dequantized"
    )
    assert choose_fp8("cpu", None)[1] == "CPU without a GPU capability: e4m3 bytes stored as uint8 and dequantized"


@pytest.mark.parametrize("cap,native", [((9, 3), False), ((9, 4), True), ((9, 9), True), ((10, 0), False)])
def test_rocm_native_fp8_spans_cdna3_and_later_cdna_only(cap, native):
    """gfx94x/gfx95x (9.4 and up within 9.x) have fp8 matrix cores; gfx10+ (RDNA, 10.x) does not."""
    assert choose_fp8("rocm", cap)[0].native is native


@pytest.mark.parametrize("conv", [NATIVE_E4M3_FNUZ, EMULATED_E4M3_FNUZ], ids=lambda c: c.name)
def test_fnuz_conventions_quantize_in_their_own_format(conv):
    """ROCm's e4m3fnuz (bias 8, max 240) all the way through quantize, the per-channel weights
    and dequantize: bytes equal torch's own fnuz cast of the same fp32 values."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 32, generator=g) * 3
    x[:, ::8] = 240.0  # every group, row and the tensor has amax 240: scale 1, x / scale is x
    # below e4m3fn's smallest normal (2**-6) the two grids differ: fnuz has one more binade
    x[:, 1::8] = torch.tensor([0.005, -0.003, 0.0011, 0.007]).unsqueeze(1)

    def fnuz_bytes(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float8_e4m3fnuz).view(torch.uint8)

    def as_bytes(q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.uint8) if conv.native else q

    q, scale = quantize(x, conv)
    assert scale == 1 and torch.equal(as_bytes(q), fnuz_bytes(x))
    assert not torch.equal(fnuz_bytes(x).view(torch.float8_e4m3fnuz).float(), x.to(torch.float8_e4m3fn).float())
    qg, sg = quantize(x, conv, group_size=8)
    assert torch.equal(as_bytes(qg), fnuz_bytes((x.reshape(4, 4, 8) / sg.unsqueeze(-1)).reshape(4, 32)))
    qw, sw = quantize_weight_per_channel(x, conv)
    assert torch.equal(as_bytes(qw), fnuz_bytes(x / sw.unsqueeze(1)))
    expected = fnuz_bytes(x / sw.unsqueeze(1)).view(torch.float8_e4m3fnuz).to(torch.float32) * sw.unsqueeze(1)
    assert torch.equal(dequantize(qw, sw, conv), expected)


def test_dequantize_returns_the_asked_dtype():
    x = torch.randn(3, 16)
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, s = quantize(x, conv)
        qg, sg = quantize(x, conv, group_size=8)
        qw, sw = quantize_weight_per_channel(x, conv)
        for y in (dequantize(q, s, conv, torch.bfloat16), dequantize(qg, sg, conv, torch.bfloat16, group_size=8),
                  dequantize(qw, sw, conv, torch.bfloat16)):  # fmt: skip
            assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_group_quantization_of_activations_with_leading_dimensions():
    """Activations [batch, tokens, hidden] group along the last dimension only."""
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    for conv in (NATIVE_E4M3, EMULATED_E4M3):
        q, scale = quantize(x, conv, group_size=16)
        assert q.shape == (2, 3, 64) and scale.shape == (2, 3, 4)
        assert torch.equal(scale, x.reshape(2, 3, 4, 16).abs().amax(-1) / 448)
        y = dequantize(q, scale, conv, group_size=16)
        torch.testing.assert_close(y, x, rtol=2**-4, atol=float(scale.max()) * 2.0**-9)
    with pytest.raises(ValueError, match=r"`group_size=5` must be positive and divide the last dimension \(64\)"):
        quantize(x, NATIVE_E4M3, group_size=5)
    with pytest.raises(ValueError, match="`group_size=0`"):
        quantize(x, NATIVE_E4M3, group_size=0)
    q1, s1 = quantize(x[0, 0, :4], EMULATED_E4M3, group_size=1)  # one scale per value: each is +-448
    assert torch.equal(decode_e4m3(q1), torch.where(x[0, 0, :4] < 0, -448.0, 448.0))


def test_fnuz_has_no_negative_zero_byte():
    """0x80 is fnuz's NaN: a negative zero must encode as 0x00."""
    assert encode_e4m3(torch.tensor([-0.0, 0.0]), "e4m3fnuz").tolist() == [0, 0]
    assert encode_e4m3(torch.tensor([-0.0]), "e4m3fn").tolist() == [0x80]
