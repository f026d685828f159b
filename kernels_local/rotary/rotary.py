"""The rotary position embedding's torch reference (rotate_half layout, partial rotary).

The one torch form of the rotation: the repository's CPU kernel (cpu.py) and its layers fall back
to it, and the model's `apply_rotary` (workers/model/rope.py) calls it through `rotary_cpu`.
"""

from __future__ import annotations

import torch


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., T, heads, D] by cos, sin [T, 1, R/2] over its first R dims; the rest pass through."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)  # [..., T, heads, D/2] each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]), dim=-1)
