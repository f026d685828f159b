"""e4m3 arithmetic in torch for the fp8 linear layers: per-token activation quantization and
byte decoding.

Values are rounded onto the e4m3 grid in fp32 (round-to-nearest-even, saturating) before
any downcast, so a cast of the result to an fp8 dtype is exact and the native and emulated
paths see the same numbers. This repository is self-contained (a `kernels` repository
imports nothing from the server); the host's own quantizer uses the same rule, and a test
checks the two agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class E4M3:
    """One e4m3 flavour: `e4m3fn` (OCP, NVIDIA) or `e4m3fnuz` (AMD CDNA3)."""

    name: str
    bias: int
    max_value: float
    torch_dtype_name: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype_name)


FORMATS = {
    "e4m3fn": E4M3("e4m3fn", bias=7, max_value=448.0, torch_dtype_name="float8_e4m3fn"),
    "e4m3fnuz": E4M3("e4m3fnuz", bias=8, max_value=240.0, torch_dtype_name="float8_e4m3fnuz"),
}


def get_format(fmt: str) -> E4M3:
    if fmt not in FORMATS:
        raise ValueError(f"Unknown e4m3 format `{fmt}`. Supported: {', '.join(sorted(FORMATS))}")
    return FORMATS[fmt]


def round_to_grid(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values rounded onto the e4m3 grid (RNE, saturating at the format's max)."""
    f = get_format(fmt)
    x = x.to(torch.float32)
    a = x.abs()
    # 1. exponent of each value, floored at the smallest normal (subnormals share its spacing)
    _, e = torch.frexp(a)
    exp = (e - 1).clamp(min=1 - f.bias)
    # 2. spacing of 3 mantissa bits at that exponent; dividing by a power of two is exact
    step = torch.exp2((exp - 3).to(torch.float32))
    # 3. round half to even on the grid, saturate, restore the sign
    r = torch.copysign((torch.round(a / step) * step).clamp(max=f.max_value), x)
    if fmt == "e4m3fnuz":
        r = torch.where(r == 0, torch.zeros_like(r), r)  # fnuz has no negative zero
    return r


def quantize_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of x [M, K]: on-grid fp32 values [M, K] and fp32 scales [M, 1]."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    scale = (amax / get_format(fmt).max_value).clamp(min=torch.finfo(torch.float32).tiny)
    return round_to_grid(x32 / scale, fmt), scale


@cache
def _decode_table(fmt: str) -> torch.Tensor:
    f = get_format(fmt)
    b = torch.arange(256, dtype=torch.int32)
    sign = torch.where((b >> 7) == 1, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = sign * (8 + man) * torch.exp2((exp - f.bias - 3).to(torch.float32))
    sub = sign * man * 2.0 ** (-f.bias - 2)
    return torch.where(exp == 0, sub, normal)


def decode(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 e4m3 bytes (exact; NaN encodings are not expected in weights)."""
    return _decode_table(fmt).to(q.device)[q.to(torch.int64)]
