"""Tensors to fp8 bytes and back, in one worker's convention: per tensor, per token group, per channel.

`quantize` scales a tensor by its amax over the format's largest value, rounds onto the e4m3
grid in fp32 (workers/quant/e4m3.py) and stores the result in the convention's storage dtype
(an fp8 dtype when native, uint8 bytes when emulated); `dequantize` inverts it. The
convention decides the storage, the caller the granularity: weights take one scale per
output channel, activations one per token. Scales are fp32 and never zero (a tensor of
zeros gets the smallest normal), so dequantizing never divides by zero.
"""

from __future__ import annotations

import torch

from workers.quant.e4m3 import decode_e4m3, encode_e4m3, round_to_e4m3
from workers.quant.fp8_convention import Fp8Convention


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
