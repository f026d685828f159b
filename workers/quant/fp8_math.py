"""The torch reference arithmetic of fp8 checkpoints: stored bytes to values, activations onto the grid, fn to fnuz.

Design: every step is a cast of torch's own fp8 dtypes, which round from fp32 once (to nearest
even) and are exact from fp8 to fp32, so this needs no bit manipulation of its own (and no import
of `workers.fp8`, which sits above the loader). Weight scales live in one layout for every scheme:
`scale` [ceil(N / group_n), ceil(K / group_k)] fp32, the value of weight (n, k) being
`q[n, k] * scale[n // group_n, k // group_k]`: per-tensor and per-channel scales are rows of one
column (group_k = K), blocks are 128 x 128 (or 1 x 128 where fused parts do not align on blocks).
The ROCm conversion is vLLM's: the same byte read as e4m3fnuz is half the e4m3fn value (bias 8
against 7), so the bytes are kept and the scales doubled; the one byte whose meaning differs
beyond that, 0x80 (e4m3fn -0, e4m3fnuz NaN), becomes 0. An e4m3fn NaN byte (0x7f, 0xff), which no
quantizer writes, would read as +-240 under fnuz. The trade-off of the layout: a per-tensor scale
is stored once per row (4 bytes per row, nothing per weight).
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
MAX_VALUES = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
FNUZ_NAN_BYTE = 0x80  # e4m3fn's -0; e4m3fnuz's only NaN


def fp8_values(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of e4m3 bytes: an fp8 tensor, or uint8 storage read as `fmt` (exact)."""
    if q.dtype == torch.uint8:
        q = q.view(FP8_DTYPES[fmt])
    return q.to(torch.float32)


def expand_scales(scale: torch.Tensor, n: int, k: int, group_n: int, group_k: int) -> torch.Tensor:
    """The [N, K] scale of every weight from the grouped layout (each stored value repeated, never changed)."""
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
    The caller doubles the scales."""
    b = q.view(torch.uint8).clone()
    b[b == FNUZ_NAN_BYTE] = 0
    return b
