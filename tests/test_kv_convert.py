"""KV blocks between KV dtypes: exact or refused (workers/kvtier/convert.py)."""

from __future__ import annotations

import pytest
import torch

from workers.kvtier.convert import exact_cast


def _kv_like(dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 2, 4, 16, 64, generator=g) * 3).to(dtype)  # [layers, 2, Hkv, B, D]


def test_bf16_to_fp16_is_exact_within_range_and_bits_survive():
    block = _kv_like()
    out = exact_cast(block, torch.float16)
    assert out.exact and out.block.dtype == torch.float16 and "exact within fp16's normal range" in out.reason
    assert torch.equal(out.block.to(torch.bfloat16), block)


@pytest.mark.parametrize("value, word", [(1.0e5, "largest 99840"), (3.0e-6, "smallest 2.995")])
def test_a_value_out_of_fp16_range_refuses_the_whole_block_and_says_why(value, word):
    """Guards the round-trip proof: beyond 65504 (inf in fp16) or below fp16's normal range (a
    subnormal loses bits) the block is refused, never rounded."""
    block = _kv_like()
    block[0, 1, 2, 3, 4] = value
    out = exact_cast(block, torch.float16)
    assert not out.exact and out.block is None
    assert out.reason.startswith("1 of 16384 values") and word in out.reason, out.reason


def test_nan_stays_nan_and_same_dtype_is_untouched():
    block = _kv_like()
    block[0, 0, 0, 0, 0] = float("nan")
    out = exact_cast(block, torch.float16)
    assert out.exact and torch.isnan(out.block[0, 0, 0, 0, 0])
    same = exact_cast(block, torch.bfloat16)
    assert same.exact and same.block is block


def test_fp16_to_bf16_converts_only_values_that_fit():
    assert not exact_cast(_kv_like(torch.float16), torch.bfloat16).exact  # 11 significant bits do not fit in 8
    fits = torch.tensor([0.5, -2.0, 3.0, 0.0], dtype=torch.float16)
    out = exact_cast(fits, torch.bfloat16)
    assert out.exact and torch.equal(out.block.float(), fits.float())


def test_fp8_only_when_every_value_is_representable():
    assert not exact_cast(_kv_like(), torch.float8_e4m3fn).exact
    grid = torch.tensor([0.5, 1.0, 1.5, -448.0], dtype=torch.bfloat16)
    assert exact_cast(grid, torch.float8_e4m3fn).exact
