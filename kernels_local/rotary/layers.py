"""Kernel layers for the rotary embedding (`kernels` layer rules).

The model applies its rotary as a function (workers/model/rope.py `apply_rotary`), which takes the
C++ kernel of cpu.py directly; these layers make the repository loadable through `kernels`
(`LocalLayerRepository`) as every other one, for a module whose forward is `forward(self, x, cos,
sin)`. Each is stateless: `Rotary` is the torch reference, `RotaryCpu` the C++ kernel where it runs
(cpu.py `runs`), the reference otherwise. No Triton kernel: `COMPILE_SPECS` declares nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu import rotary_cpu
from .rotary import rotary_reference


class Rotary(nn.Module):
    """Torch reference (any device)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary_reference(x, cos, sin)


class RotaryCpu(nn.Module):
    """C++ on the CPU, one pass per token (cpu.py); the torch reference under torch.compile."""

    has_backward = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary_cpu(x, cos, sin)


# No Triton layer, nothing to compile ahead of time.
COMPILE_SPECS: dict = {}
