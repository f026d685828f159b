"""Kernel layers replacing the model's `RMSNorm` forward (`kernels` layer rules).

Each layer is stateless: no `__init__`, only `forward(self, hidden_states)`, reading the
`weight` and `variance_epsilon` of the module it replaces. The Triton layers differ only in
their launch tuning; on CPU tensors they run the torch reference (see `rms_norm`). A CPU
worker's `RMSNormCpu` runs the C++ kernel of cpu.py.
`COMPILE_SPECS` names, per Triton layer, the launches its forward can make (the preflight
compiles them ahead of time); each entry's tuning is the one its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .cpu import rms_norm_cpu
from .rmsnorm import HOPPER, PRE_HOPPER, ROCM, compile_specs, rms_norm, rms_norm_reference


class RMSNorm(nn.Module):
    """Torch reference (CUDA below sm_70; the CPU where the C++ kernel cannot build)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(hidden_states, self.weight, self.variance_epsilon)


class RMSNormCpu(nn.Module):
    """C++ on the CPU, one pass per row (cpu.py); the torch reference under torch.compile."""

    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_cpu(hidden_states, self.weight, self.variance_epsilon)


class RMSNormTritonSm70(nn.Module):
    """Triton, pre-Hopper tuning (sm_70..sm_89): one row per program."""

    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, PRE_HOPPER)


class RMSNormTritonSm90(nn.Module):
    """Triton, Hopper-and-later tuning (sm_90+): several narrow rows per program."""

    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, HOPPER)


class RMSNormTritonRocm(nn.Module):
    """Triton, ROCm tuning (64-lane wavefronts)."""

    has_backward = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "RMSNormTritonSm70": partial(compile_specs, PRE_HOPPER),
    "RMSNormTritonSm90": partial(compile_specs, HOPPER),
    "RMSNormTritonRocm": partial(compile_specs, ROCM),
}
