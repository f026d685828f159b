"""Kernel layers replacing an `nn.Linear` forward on the CPU (`kernels` layer rules).

A CPU worker lays its projections' weights out as column panels and routes each projection through
them itself (workers/model/cpu_projections.py: packs or panels per weight, row buckets, an opaque op
inside `torch.compile`); these layers make the repository loadable through `kernels`
(`LocalLayerRepository`) as every other one, for a module shaped as `nn.Linear` (`weight` [N, K],
`bias`). Each is stateless: `Linear` is the torch reference, `PanelLinearCpu` multiplies through the
panels kept on the weight (cpu.py `PACKED_ATTR`, laid out by `panels`) where it has them, the
reference otherwise. No Triton kernel: `COMPILE_SPECS` declares nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import panel_linear_cpu


class Linear(nn.Module):
    """Torch reference (any device): `F.linear`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class PanelLinearCpu(nn.Module):
    """brgemm over the weight's column panels on the CPU (cpu.py); the reference without them."""

    has_backward = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return panel_linear_cpu(input, self.weight, self.bias)


# No Triton layer, nothing to compile ahead of time.
COMPILE_SPECS: dict = {}
