"""GGUF tensor types to float32 in torch, bit for bit equal to gguf-py's `gguf.quants.dequantize`.

Design: one function per type over a tensor of whole blocks ([n_blocks, type_size] uint8 ->
[n_blocks, block_size] float32), each step in the order gguf-py (and ggml's reference C) does
it: fp16 scales widened to float32 first, the integer codes unpacked in int32 (torch's shifts on
uint8 and int32 broadcast alike), then the products and sums in float32 with no fused step, so
every element rounds as the reference rounds it. `dequantize(packed, type, shape)` turns a row
of blocks back into the tensor's shape. Trade-off: this is the load-time path (the model's
weights in its dtype, kept unpacked); kernels that keep the blocks packed use the same layouts
and take these functions as their reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.gguf.files import GGUFError

QK_K = 256  # elements of a K-block (and an IQ4_XS block)

# (elements, bytes) per block, as ggml's GGML_QUANT_SIZES
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136), "MXFP4": (32, 17),
}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4's non-linear grid
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled


class UnsupportedTensorType(GGUFError):
    """A GGUF tensor type this server does not dequantize."""


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 (little-endian fp16) -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _i32(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32)


def _shifts(*values: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).reshape(shape)


def _nibbles(qs: torch.Tensor, n: int, half: int) -> torch.Tensor:
    """Low nibbles of each `half` bytes, then their high nibbles: [n, -1, 2, half] int32."""
    return (_i32(qs).reshape(n, -1, 1, half) >> _shifts(0, 4, shape=(1, 1, 2, 1))) & 0x0F


def _bits(qh: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """Bit j of a little-endian 32-bit word, for j < count: [n, count] int32."""
    word = _i32(qh).reshape(n, 4) << _shifts(0, 8, 16, 24, shape=(1, 4))
    word = word.sum(dim=1, keepdim=True)  # the bytes never overlap: the sum is their OR (wraps like uint32)
    return (word >> torch.arange(count, dtype=torch.int32).reshape(1, count)) & 1


# ---- the 32-element blocks ----------------------------------------------------------------------
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d, x = _f16(b[:, :2]), b[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = _nibbles(b[:, 2:], n, 16).reshape(n, -1) - 8
    return _f16(b[:, :2]) * qs.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = _nibbles(b[:, 4:], n, 16).reshape(n, -1).float()
    return _f16(b[:, :2]) * qs + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0 / Q5_1's 5-bit codes: 4 low bits in qs, the fifth in the 32-bit qh."""
    n = b.shape[0]
    qh = _bits(b[:, offset:offset + 4], n, 32)
    ql = _nibbles(b[:, offset + 4:], n, 16).reshape(n, -1)
    return ql | (qh << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4).float() + _f16(b[:, 2:4])


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = _nibbles(b[:, 2:], n, 16).reshape(n, -1)
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return _f16(b[:, :2]) * values[qs]


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """An MXFP4 block's shared exponent as float32, halved (ggml's `ggml_e8m0_to_fp32_half`)."""
    e = _i32(e)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = (_i32(b[:, 1:]).reshape(n, 1, 16) >> _shifts(0, 4, shape=(1, 2, 1))) & 0x0F
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    return _e8m0_half(b[:, :1]) * values[qs.reshape(n, 32)]


# ---- the 256-element K-blocks ---------------------------------------------------------------------
def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's eight 6-bit scales and eight 6-bit mins from their 12 bytes: ([n, 8], [n, 8])."""
    n = scales.shape[0]
    s = _i32(scales).reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = _i32(b[:, :16]), _i32(b[:, 16:80])
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales, d = _i32(b[:, :32]), _i32(b[:, 32:96]), _i32(b[:, 96:108]), _f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4, shape=(1, 2, 1))).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1))).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)) - 32
    dl = (d * sc.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql - ((qh ^ 1) << 2)  # the high bit subtracts 4 where the mask is clear
    return (dl * q.float()).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], n, 32).reshape(n, -1, 32).float()
    return (dl * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    ql = _nibbles(b[:, 48:], n, 32).reshape(n, -1, 32)
    qh = ((_i32(b[:, 16:48]).reshape(n, -1, 1, 32) >> torch.arange(8, dtype=torch.int32).reshape(1, 1, 8, 1))
          & 1).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    ql = _nibbles(b[:, :128], n, 64).reshape(n, -1, 32)
    qh = ((_i32(b[:, 128:192]).reshape(n, -1, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1))) & 3).reshape(n, -1, 32)
    q = ((ql | (qh << 4)) - 32).reshape(n, 16, -1).float()
    return (d * q).reshape(n, QK_K)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    scales_h = _i32(b[:, 2]) | (_i32(b[:, 3]) << 8)  # one little-endian uint16
    scales_l = (_i32(b[:, 4:8]).reshape(n, -1, 1) >> _shifts(0, 4, shape=(1, 1, 2))).reshape(n, -1) & 0x0F
    scales_h = (scales_h.reshape(n, 1) >> (2 * torch.arange(8, dtype=torch.int32)).reshape(1, 8)) & 0x03
    sc = (scales_l | (scales_h << 4)) - 32
    dl = (d * sc.float()).reshape(n, -1, 1)
    qs = _nibbles(b[:, 8:], n, 16).reshape(n, -1, 32)
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32)
    return (dl * values[qs]).reshape(n, -1)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _f16_type(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()  # exact: the bits shifted into float32's high half


DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32, "F16": _f16_type, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}
TYPES = tuple(DEQUANTIZE)


def check_type(type_name: str, tensor: str = "") -> None:
    """`UnsupportedTensorType` naming a type we cannot dequantize (and the tensor), listing those we can."""
    if type_name not in DEQUANTIZE:
        where = f" of tensor `{tensor}`" if tensor else ""
        raise UnsupportedTensorType(f"Unsupported GGUF tensor type `{type_name}`{where}. Supported: {', '.join(TYPES)}")


def dequantize(packed: torch.Tensor, type_name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Float32 values of a GGUF tensor's bytes (`packed`: uint8, any shape whose bytes are whole blocks);
    `shape`: the tensor's shape in torch order (rows first), default: one flat row."""
    check_type(type_name)
    elements, size = BLOCKS[type_name]
    raw = packed.reshape(-1).view(torch.uint8) if packed.dtype != torch.uint8 else packed.reshape(-1)
    if raw.numel() % size:
        raise ValueError(f"{raw.numel()} bytes are no whole number of `{type_name}` blocks of {size} bytes")
    values = DEQUANTIZE[type_name](raw.reshape(-1, size))
    return values.reshape(shape if shape is not None else (-1,))
