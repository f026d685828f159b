"""The fp8 kernel repository's torch-side e4m3 helpers (`kernels_local/fp8_linear/quant.py`:
`round_to_grid`, `quantize_rows`, `decode`, `get_format`) against torch's own casts and the
host quantizer, in this process and without the Triton interpreter (the Triton kernels
themselves are checked in tests/test_kernels_triton.py)."""

from __future__ import annotations

import pytest
import torch

from kernels_local.fp8_linear import quant
from workers.quant.e4m3 import round_to_e4m3
from workers.quant.fp8_convention import choose_fp8
from workers.quant.fp8_quantize import quantize

FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}


def _samples(max_value: float, seed: int) -> torch.Tensor:
    """Random values over the format's range, its ties, subnormals, zeros and both extremes."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(1 << 16, generator=g) * 2 - 1) * max_value
    special = [0.0, -0.0, max_value, -max_value, 2 * max_value, 2.0**-9, -(2.0**-10), 1.0625, 17.0, 2.0**-7 * 1.5]
    x[: len(special)] = torch.tensor(special)
    return x


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_to_grid_is_torchs_round_to_nearest_even_and_the_hosts(fmt):
    f = quant.get_format(fmt)
    x = _samples(f.max_value, seed=len(fmt))
    grid = quant.round_to_grid(x, fmt)
    # saturating cast: torch's own cast of values clamped to the format's range
    expected = x.clamp(-f.max_value, f.max_value).to(FORMATS[fmt]).to(torch.float32)
    assert torch.equal(grid, expected)
    assert torch.equal(grid, round_to_e4m3(x, fmt))
    if fmt == "e4m3fnuz":
        assert not torch.signbit(grid[grid == 0]).any()  # fnuz has no negative zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantize_rows_equals_the_host_quantizer_bit_for_bit(fmt, dtype):
    """Per-token scales (amax / max, floored for an all-zero row) and grid values, against
    `workers.quant.fp8_quantize(..., group_size=K)`: the host and the kernel repository use one rule."""
    native = choose_fp8("rocm" if fmt == "e4m3fnuz" else "cuda", (9, 4) if fmt == "e4m3fnuz" else (9, 0))[0]
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 40, generator=g) * torch.tensor([1.0, 1e-3, 300.0, 0.0, 7.0]).unsqueeze(1)).to(dtype)
    grid, scale = quant.quantize_rows(x, fmt)
    q, host_scale = quantize(x, native, group_size=x.shape[-1])
    assert scale.shape == (5, 1) and torch.equal(scale, host_scale)
    assert torch.equal(grid, q.to(torch.float32))
    assert scale[3].item() == torch.finfo(torch.float32).tiny and torch.equal(grid[3], torch.zeros(40))
    torch.testing.assert_close(grid * scale, x.float(), rtol=2**-4, atol=float(scale.max()) * 2.0**-9)


def test_quantize_rows_rounds_in_fp32_before_any_downcast():
    """Guards `return round_to_grid(x32 / scale, fmt), scale` in `quantize_rows` (x / scale in
    fp32): rounding x / scale to float16 first would round twice. The row's amax is 448, so its
    scale is 1; each other value sits just off the midpoint of two e4m3 neighbours, where float16
    would first round it onto the midpoint and the tie would go to the even neighbour."""
    row = torch.tensor([[448.0, 1.0625 + 2**-12, 1.1875 - 2**-12, 17.0 + 2**-8]])
    grid, scale = quant.quantize_rows(row, "e4m3fn")
    assert scale.item() == 1.0
    assert grid.tolist() == [[448.0, 1.125, 1.125, 18.0]]
    assert quant.round_to_grid(row.half().float(), "e4m3fn").tolist() == [[448.0, 1.0, 1.25, 16.0]]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_decode_reads_every_byte_as_torch_does(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    theirs = codes.view(FORMATS[fmt]).to(torch.float32)
    finite = torch.isfinite(theirs)
    assert torch.equal(quant.decode(codes, fmt)[finite], theirs[finite])
    assert torch.equal(quant.decode(codes.reshape(16, 16), fmt), quant.decode(codes, fmt).reshape(16, 16))


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="Unknown e4m3 format `e5m2`. Supported: e4m3fn, e4m3fnuz"):
        quant.get_format("e5m2")
    assert quant.get_format("e4m3fnuz").torch_dtype is torch.float8_e4m3fnuz
