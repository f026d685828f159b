"""Kernel layers for greedy rows (`kernels` layer rules).

Sampling is no model layer: the sampler takes the C++ kernel of cpu.py directly
(workers/sampling/sampler.py). These layers make the repository loadable through `kernels`
(`LocalLayerRepository`) as every other one, for a module whose forward is `forward(self,
logits)` -> (ids [N], logprobs [N]). Each is stateless: `GreedyRows` is the torch reference,
`GreedyRowsCpu` the C++ kernel where it runs (cpu.py `runs`), the reference otherwise. No Triton
kernel: `COMPILE_SPECS` declares nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu import greedy_rows
from .greedy import greedy_reference


class GreedyRows(nn.Module):
    """Torch reference (any device): log_softmax, argmax, gather."""

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return greedy_reference(logits)


class GreedyRowsCpu(nn.Module):
    """C++ on the CPU, one pass per row (cpu.py); the torch reference elsewhere."""

    has_backward = False

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return greedy_rows(logits)


# No Triton layer, nothing to compile ahead of time.
COMPILE_SPECS: dict = {}
