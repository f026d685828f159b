"""The fp8 arithmetic, once: the e4m3 formats, exact rounding onto their grid, bytes to values, scale layouts.

Design: OCP `e4m3fn` (NVIDIA, AMD CDNA4) and `e4m3fnuz` (AMD CDNA3) are `FORMATS`, which every
caller takes its constants from. Values are rounded onto the grid in fp32 (to nearest even,
saturating) before any downcast, so the native path (a cast of values on the grid) and the
emulated one (`round_to_e4m3` / `encode_e4m3` / `decode_e4m3`, integer and fp32 operations only)
give identical bytes, where a direct fp32 -> fp16 -> e4m3 cast would round twice. A checkpoint's
bytes are read with torch's fp8 dtypes (`fp8_values`) and its weight scales kept in one layout
for every scheme: `scale` [ceil(N / group_n), ceil(K / group_k)] fp32, weight (n, k) being
`q[n, k] * scale[n // group_n, k // group_k]`. CDNA3 takes the same bytes with doubled scales
(vLLM's conversion), 0x80 (e4m3fn's -0, fnuz's NaN) becoming 0. Trade-off: one extra fp32 pass
over each tensor quantized, paid at load for weights, and a per-tensor scale stored once per row."""

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
FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}  # torch's own, by flavour
MAX_VALUES = {name: f.max_value for name, f in FORMATS.items()}
FNUZ_NAN_BYTE = E4M3FNUZ.nan_byte  # e4m3fn's -0; e4m3fnuz's only NaN


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


# -- a checkpoint's fp8 bytes and scales ------------------------------------------------------------


def fp8_values(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of e4m3 bytes: an fp8 tensor, or uint8 storage read as `fmt` (exact)."""
    if q.dtype == torch.uint8:
        q = q.view(FP8_DTYPES[fmt])
    return q.to(torch.float32)


def expand_scales(scale: torch.Tensor, n: int, k: int, group_n: int, group_k: int) -> torch.Tensor:
    """The [N, K] scale of every weight from the grouped layout (each stored value repeated, never changed):
    per-tensor and per-channel scales are rows of one column (`group_k` = K), blocks 128 x 128, or
    1 x 128 where fused parts do not align on blocks."""
    s = scale.to(torch.float32)
    if group_n > 1:
        s = s.repeat_interleave(group_n, dim=0)
    if group_k < k:
        s = s.repeat_interleave(group_k, dim=1)
    return s[:n, :k].expand(n, k)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int, fmt: str) -> torch.Tensor:
    """Weight values [N, K] in fp32: each byte's value times its group's scale (one rounding)."""
    n, k = q.shape
    return fp8_values(q, fmt) * expand_scales(scale, n, k, group_n, group_k)


def to_grid(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale saturated at the format's largest value and rounded onto the e4m3 grid, as fp32."""
    m = MAX_VALUES[fmt]
    return (x.to(torch.float32) / scale).clamp(-m, m).to(FP8_DTYPES[fmt]).to(torch.float32)


def quantize_activations(x: torch.Tensor, activations: str, fmt: str, input_scale: torch.Tensor | None = None,
                         group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [M, K] -> (grid values [M, K] fp32, scales [M, G] fp32): per token (G = 1), per token and
    `group` columns (G = ceil(K / group)), or with the static per-tensor `input_scale` (G = 1)."""
    x32 = x.to(torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    if activations == "static_tensor":
        scale = input_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
        return to_grid(x32, scale, fmt), scale
    if activations == "dynamic_token":
        scale = (x32.abs().amax(dim=-1, keepdim=True) / MAX_VALUES[fmt]).clamp(min=tiny)  # [M, 1]
        return to_grid(x32, scale, fmt), scale
    m, k = x.shape
    groups = -(-k // group)  # the last group may be narrower
    g = torch.nn.functional.pad(x32, (0, groups * group - k)).reshape(m, groups, group)  # [M, G, group]
    scale = (g.abs().amax(dim=-1) / MAX_VALUES[fmt]).clamp(min=tiny)  # [M, G]
    return to_grid(g, scale[..., None], fmt).reshape(m, groups * group)[:, :k], scale


def dequantize_activations(grid: torch.Tensor, scale: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """grid [M, K] times its scales [M, G]: one per row, or one per `group` columns."""
    if group is None:
        return grid * scale
    return grid * scale.repeat_interleave(group, dim=1)[:, : grid.shape[1]]


def fn_to_fnuz(q: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (any 1-byte dtype) as e4m3fnuz bytes (uint8) of half the value: 0x80 (-0) -> 0.
    The caller doubles the scales. An e4m3fn NaN byte (0x7f, 0xff), which no quantizer writes,
    would read as +-240 under fnuz."""
    b = q.view(torch.uint8).clone()
    b[b == FNUZ_NAN_BYTE] = 0
    return b
