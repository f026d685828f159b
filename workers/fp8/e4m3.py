"""The e4m3 formats and exact rounding onto their grid, with integer-only encoding and decoding.

Two flavours of 1 sign, 4 exponent and 3 mantissa bits: OCP `e4m3fn` (NVIDIA, AMD CDNA4;
bias 7, max 448) and `e4m3fnuz` (AMD CDNA3; bias 8, max 240, no negative zero). Values are
rounded onto the grid in fp32 (round-to-nearest-even, saturating) before any downcast, so the
native path (a cast of values already on the grid: exact) and the emulated path (the integer
encoding below of the same values) give identical bytes; a direct fp32 -> fp16 -> e4m3 cast
rounds twice and shrinks about 0.4% of values by one ULP. The trade-off: one extra fp32 pass
over each tensor quantized, paid at load time for weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class E4M3Format:
    """Bit layout of an e4m3 flavour: 1 sign, 4 exponent, 3 mantissa bits."""

    name: str  # "e4m3fn" (OCP: NVIDIA, AMD CDNA4) | "e4m3fnuz" (AMD CDNA3)
    bias: int
    max_value: float
    nan_byte: int

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

E4M3FN = E4M3Format("e4m3fn", bias=7, max_value=448.0, nan_byte=0x7F)

E4M3FNUZ = E4M3Format("e4m3fnuz", bias=8, max_value=240.0, nan_byte=0x80)

FORMATS = {f.name: f for f in (E4M3FN, E4M3FNUZ)}

def round_to_e4m3(x: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """fp32 values on the e4m3 grid: round-to-nearest-even, saturating at the format's max."""
    f = FORMATS[fmt]
    x = x.to(torch.float32)
    a = x.abs()
    # 1. exponent of each value, floored at the smallest normal (subnormals share its spacing)
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exp = (e - 1).clamp(min=f.min_normal_exp)
    # 2. grid spacing is 2**(exp - 3) for 3 mantissa bits; dividing by a power of two is exact
    step = torch.exp2((exp - 3).to(torch.float32))
    # 3. round half to even on the grid, then saturate
    r = (torch.round(a / step) * step).clamp(max=f.max_value)
    r = torch.copysign(r, x)
    if f.name == "e4m3fnuz":
        r = torch.where(r == 0, torch.zeros_like(r), r)  # fnuz has no negative zero
    return r

def encode_e4m3(grid: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """uint8 bytes of fp32 values already on the e4m3 grid, with integer ops only (emulated path)."""
    f = FORMATS[fmt]
    g = grid.to(torch.float32).contiguous()
    bits = g.view(torch.int32)
    sign = ((bits >> 31) & 1).to(torch.int32)
    a = g.abs()
    normal = a >= 2.0**f.min_normal_exp
    # normals: re-bias the fp32 exponent, keep the top 3 mantissa bits (exact on the grid)
    e32 = (bits >> 23) & 0xFF
    exp8 = torch.where(normal, e32 - 127 + f.bias, torch.zeros_like(e32))
    man_n = (bits >> 20) & 0x7
    # subnormals: an integer multiple of the smallest spacing
    man_s = torch.round(a / 2.0 ** (f.min_normal_exp - 3)).to(torch.int32)
    man = torch.where(normal, man_n, man_s)
    out = (sign << 7) | (exp8 << 3) | man
    if f.name == "e4m3fnuz":
        out = torch.where(a == 0, torch.zeros_like(out), out)
    out = torch.where(torch.isnan(g), torch.full_like(out, f.nan_byte), out)
    return out.to(torch.uint8)

@cache
def _decode_table(fmt: str) -> torch.Tensor:
    f = FORMATS[fmt]
    b = torch.arange(256, dtype=torch.int32)
    sign = torch.where((b >> 7) == 1, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    normal = sign * (1 + man / 8) * torch.exp2((exp - f.bias).to(torch.float32))
    sub = sign * man * 2.0 ** (f.min_normal_exp - 3)
    vals = torch.where(exp == 0, sub, normal)
    vals[f.nan_byte] = float("nan")
    if f.name == "e4m3fn":
        vals[0xFF] = float("nan")
    return vals

def decode_e4m3(q: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """fp32 values of uint8 e4m3 bytes (a 256-entry table: exact)."""
    return _decode_table(fmt).to(q.device)[q.to(torch.int64)]
