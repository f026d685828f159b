"""4-bit weights unpacked to integers and dequantized exactly as each format's reference computes them.

Design: one unpacking primitive (`unpack_int32`: eight 4-bit values per int32 word, value j in
bits 4j..4j+3, along either dim, optionally in AWQ's interleaved order) and one dequantizing step
per layout (GPTQ, AWQ, pack-quantized; docs/quantization-int4.md), each returning the weight
[out, in] in the dtype of the stored scales. Every reference forms `q - z` (exact in any float
type) and multiplies once by the scale in its dtype; here the product is taken in fp32, exact for
a 5-bit integer times an fp16/bf16 value, and rounded once, the reference's bits. Trade-off: the
unpacked integers take a byte each (int32 while computing), fine at load time and the reason these
are not the run-time path."""

from __future__ import annotations

import torch

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds output column 8c + AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in word nibble AWQ_REVERSE[j]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class Int4TensorError(ValueError):
    """A 4-bit layer's stored tensors are not what its format stores (dtype, shape, values)."""


def unpack_int32(packed: torch.Tensor, count: int, dim: int = -1, awq_order: bool = False) -> torch.Tensor:
    """The 4-bit values (int32 in [0, 15]) of `packed` (int32), eight per word along `dim`, first `count` kept."""
    if packed.dtype != torch.int32:
        raise Int4TensorError(f"packed 4-bit tensor is `{packed.dtype}`; the formats store `torch.int32`")
    x = packed.movedim(dim, -1)
    nib = (x.unsqueeze(-1) >> _SHIFTS.to(x.device)) & 0xF  # [..., words, 8], word nibble i at [..., i]
    if awq_order:
        nib = nib[..., list(AWQ_REVERSE)]  # now [..., j] is column 8c + j
    return nib.flatten(-2)[..., :count].movedim(-1, dim)


def pack_int32(values: torch.Tensor, dim: int = -1, awq_order: bool = False) -> torch.Tensor:
    """The inverse of `unpack_int32` (values in [0, 15], padded with 0 to a multiple of 8 along `dim`)."""
    x = values.to(torch.int32).movedim(dim, -1)
    pad = -x.shape[-1] % 8
    x = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, 8))
    if awq_order:
        x = x[..., list(AWQ_ORDER)]  # word nibble i holds column 8c + AWQ_ORDER[i]
    words = (x << _SHIFTS.to(x.device)).sum(-1, dtype=torch.int64)  # disjoint bits: the sum is the OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def _scaled(diff: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q - z) * s rounded once to the scale's dtype (exact fp32 product, see the module docstring)."""
    if scale.dtype not in SCALE_DTYPES:
        raise Int4TensorError(f"4-bit scales are `{scale.dtype}`. Supported: {', '.join(map(str, SCALE_DTYPES))}")
    return (diff.to(torch.float32) * scale.to(torch.float32)).to(scale.dtype)


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(want):
        raise Int4TensorError(f"`{name}` has shape {tuple(t.shape)}; expected {list(want)}")


def gptq_groups(g_idx: torch.Tensor | None, in_features: int, group_size: int, groups: int) -> torch.Tensor:
    """Each input's group: `g_idx` as stored (checked), or `k // group_size` (all 0 per channel)."""
    if g_idx is None:
        k = torch.arange(in_features)
        return k // group_size if group_size > 0 else torch.zeros_like(k)
    _shape("g_idx", g_idx, (in_features,))
    g = g_idx.to(torch.int64)
    if in_features and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise Int4TensorError(f"`g_idx` holds group {int(g.min()) if int(g.min()) < 0 else int(g.max())}; "
                              f"the layer has {groups} groups (0..{groups - 1})")
    return g


def dequantize_gptq(qweight, qzeros, scales, g_idx, group_size: int, zero_offset: int) -> torch.Tensor:
    """GPTQ's weight [out, in] in the scales' dtype (`zero_offset` 1 for the v1 `gptq` format)."""
    groups, out = scales.shape
    in_features = qweight.shape[0] * 8
    _shape("qweight", qweight, (in_features // 8, out))
    _shape("qzeros", qzeros, (groups, -(-out // 8)))
    q = unpack_int32(qweight, in_features, dim=0)  # [in, out]
    z = unpack_int32(qzeros, out, dim=1)  # [groups, out]
    if zero_offset and bool((z == 15).any()):
        raise Int4TensorError("a v1 (`checkpoint_format: gptq`) zero point nibble is 15, which the references read "
                              "differently (AutoGPTQ: 0, exllama: 16). Supported: nibbles 0..14 (zero points 1..15)")
    g = gptq_groups(g_idx, in_features, group_size, groups)
    diff = q - (z + zero_offset)[g]  # [in, out]
    return _scaled(diff, scales[g]).t().contiguous()


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AWQ's weight [out, in] in the scales' dtype."""
    groups, out = scales.shape
    in_features = qweight.shape[0]
    _shape("qweight", qweight, (in_features, out // 8))
    _shape("qzeros", qzeros, (groups, out // 8))
    if groups != -(-in_features // group_size):
        raise Int4TensorError(f"`scales` has {groups} groups; {in_features} inputs in groups of {group_size} "
                              f"make {-(-in_features // group_size)}")
    q = unpack_int32(qweight, out, dim=1, awq_order=True)  # [in, out]
    z = unpack_int32(qzeros, out, dim=1, awq_order=True)  # [groups, out]
    g = torch.arange(in_features) // group_size
    return _scaled(q - z[g], scales[g]).t().contiguous()


def dequantize_pack_quantized(packed, scale, shape, zero_point, group_size: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized weight [out, in] in the scale's dtype."""
    out, in_features = (int(v) for v in shape.reshape(-1).tolist())
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    _shape("weight_packed", packed, (out, -(-in_features // 8)))
    _shape("weight_scale", scale, (out, groups))
    q = unpack_int32(packed, in_features, dim=1) - 8  # [out, in] in [-8, 7]
    g = torch.arange(in_features) // group_size if group_size > 0 else torch.zeros(in_features, dtype=torch.int64)
    if zero_point is None:
        return _scaled(q, scale[:, g])
    _shape("weight_zero_point", zero_point, (-(-out // 8), groups))
    z = unpack_int32(zero_point, out, dim=0) - 8  # [out, groups]
    return _scaled(q - z[:, g], scale[:, g])
