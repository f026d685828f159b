"""The rotary position embedding's torch reference (rotate_half layout, partial rotary).

The model's own form is workers/model/rope.py `apply_rotary`; this copy is the reference the
repository's CPU kernel (cpu.py) and its layers fall back to, since a kernel repository imports no
worker code (tests/test_kernels_repos.py holds the two equal bit for bit).
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
