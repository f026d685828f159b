"""The fp8 convention of one worker, and exact e4m3 quantization.

Design: a device gets native e4m3 at or above `NATIVE_FP8_CAPABILITY` (fp8 tensor cores),
emulated fp8 below it (uint8 storage, dequantized compute); on ROCm the encoding its matrix
cores take (the fnuz variant of e4m3 on CDNA3, OCP e4m3fn on CDNA4); the rule itself is torch-free (`workers.contract.fp8_rule`), shared with the kernel
mapping and `hetserve plan`. The choice is one frozen `Fp8Convention` value: the host's buffer dtype
(`storage_dtype`) and the kernels' compile-time flag (`native`) are both read from it, so
they cannot disagree. A process locks the first convention it uses and refuses any other
(`MixedFp8ConventionError`): a buffer made under one convention can never reach a kernel
compiled for the other.

Values are rounded onto the e4m3 grid in fp32 (round-to-nearest-even, saturating) before
any downcast, so the native path (a cast of on-grid values, exact) and the emulated path
(integer encoding of the same values) give identical bytes. The trade-off: one extra fp32
pass over each tensor we quantize, paid at load time for weights.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache

import torch

from workers.contract.fp8_rule import EMULATED, NATIVE, fp8_rule
from workers.contract.fp8_rule import NATIVE_FP8_CAPABILITY as NATIVE_FP8_CAPABILITY  # re-exported


class MixedFp8ConventionError(RuntimeError):
    """A process that already chose one fp8 convention was asked to use another."""


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
_FORMATS = {f.name: f for f in (E4M3FN, E4M3FNUZ)}


@dataclass(frozen=True)
class Fp8Convention:
    """One device's fp8 convention. `native` is the kernels' constexpr flag; `storage_dtype` the
    host's buffer dtype: both derive from this one value."""

    name: str  # "native_e4m3" | "emulated"
    native: bool
    fmt: str  # "e4m3fn" | "e4m3fnuz"

    @property
    def format(self) -> E4M3Format:
        return _FORMATS[self.fmt]

    @property
    def max_value(self) -> float:
        return self.format.max_value

    @property
    def fp8_dtype_name(self) -> str:
        return "float8_e4m3fn" if self.fmt == "e4m3fn" else "float8_e4m3fnuz"

    @property
    def storage_dtype_name(self) -> str:
        return self.fp8_dtype_name if self.native else "uint8"

    @property
    def fp8_dtype(self) -> torch.dtype:
        return getattr(torch, self.fp8_dtype_name)

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.storage_dtype_name)


NATIVE_E4M3 = Fp8Convention(NATIVE, native=True, fmt="e4m3fn")
EMULATED_E4M3 = Fp8Convention(EMULATED, native=False, fmt="e4m3fn")
NATIVE_E4M3_FNUZ = Fp8Convention(NATIVE, native=True, fmt="e4m3fnuz")
EMULATED_E4M3_FNUZ = Fp8Convention(EMULATED, native=False, fmt="e4m3fnuz")


_CONVENTIONS = {(c.name, c.fmt): c for c in (NATIVE_E4M3, EMULATED_E4M3, NATIVE_E4M3_FNUZ, EMULATED_E4M3_FNUZ)}


def choose_fp8(device_type: str, capability) -> tuple[Fp8Convention, str]:
    """The fp8 convention for one device, with the reason: `workers.contract.fp8_rule`'s
    decision as buffer dtypes. Pure: no device is touched. `capability` is (major, minor);
    90, "9.0" and "sm_90" are accepted too."""
    decision = fp8_rule(device_type, capability)
    return _CONVENTIONS[(decision.convention, decision.fmt)], decision.reason


# -- the process-wide lock ------------------------------------------------------------------

_lock = threading.Lock()
_locked: Fp8Convention | None = None


def lock_convention(conv: Fp8Convention) -> Fp8Convention:
    """Record this process's convention; a different one later raises `MixedFp8ConventionError`."""
    global _locked
    with _lock:
        if _locked is None:
            _locked = conv
        elif _locked != conv:
            raise MixedFp8ConventionError(
                f"This process already uses fp8 convention `{_locked.name}` ({_locked.storage_dtype_name} "
                f"buffers, {_locked.fmt}); refusing `{conv.name}` ({conv.storage_dtype_name}, {conv.fmt}). "
                "One process serves one device with one convention."
            )
        return _locked


def locked_convention() -> Fp8Convention | None:
    return _locked


def _reset_lock_for_tests() -> None:
    global _locked
    with _lock:
        _locked = None


# -- exact rounding and encoding --------------------------------------------------------------


def round_to_e4m3(x: torch.Tensor, fmt: str = "e4m3fn") -> torch.Tensor:
    """fp32 values on the e4m3 grid: round-to-nearest-even, saturating at the format's max."""
    f = _FORMATS[fmt]
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
    f = _FORMATS[fmt]
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
    f = _FORMATS[fmt]
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


# -- quantize / dequantize ---------------------------------------------------------------------


def _to_storage(grid: torch.Tensor, conv: Fp8Convention) -> torch.Tensor:
    if conv.native:
        return grid.to(conv.fp8_dtype)  # exact: values are already on the grid
    return encode_e4m3(grid, conv.fmt)


def _from_storage(q: torch.Tensor, conv: Fp8Convention) -> torch.Tensor:
    if conv.native:
        return q.to(torch.float32)
    return decode_e4m3(q, conv.fmt)


def _scale_from_amax(amax: torch.Tensor, conv: Fp8Convention) -> torch.Tensor:
    return (amax.to(torch.float32) / conv.max_value).clamp(min=torch.finfo(torch.float32).tiny)


def quantize(
    x: torch.Tensor, conv: Fp8Convention, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 bytes in `conv`'s storage dtype and fp32 scales: per tensor (`group_size=None`, 0-d
    scale) or per token group along the last dim (scale [..., last_dim // group_size])."""
    x32 = x.to(torch.float32)  # all arithmetic in fp32: no rounding before the e4m3 grid
    if group_size is None:
        scale = _scale_from_amax(x32.abs().amax(), conv)
        grid = round_to_e4m3(x32 / scale, conv.fmt)
        return _to_storage(grid, conv), scale
    if group_size <= 0 or x.shape[-1] % group_size != 0:
        raise ValueError(
            f"`group_size={group_size}` must be positive and divide the last dimension ({x.shape[-1]})"
        )
    g = x32.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)  # [..., G, group]
    scale = _scale_from_amax(g.abs().amax(dim=-1), conv)  # [..., G]
    grid = round_to_e4m3(g / scale.unsqueeze(-1), conv.fmt).reshape(x.shape)
    return _to_storage(grid, conv), scale


def quantize_weight_per_channel(w: torch.Tensor, conv: Fp8Convention) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [out, in] -> fp8 bytes [out, in] and one fp32 scale per output channel [out]."""
    w32 = w.to(torch.float32)
    scale = _scale_from_amax(w32.abs().amax(dim=1), conv)  # [out]
    grid = round_to_e4m3(w32 / scale.unsqueeze(1), conv.fmt)
    return _to_storage(grid, conv), scale


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    conv: Fp8Convention,
    dtype: torch.dtype = torch.float32,
    group_size: int | None = None,
) -> torch.Tensor:
    """Inverse of `quantize` (and of `quantize_weight_per_channel` with a [out] scale)."""
    v = _from_storage(q, conv)
    if group_size is not None:
        g = v.reshape(*v.shape[:-1], v.shape[-1] // group_size, group_size) * scale.unsqueeze(-1)
        return g.reshape(v.shape).to(dtype)
    if scale.dim() == 1 and v.dim() == 2 and scale.shape[0] == v.shape[0]:
        return (v * scale.unsqueeze(1)).to(dtype)
    return (v * scale).to(dtype)
