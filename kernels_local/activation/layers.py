"""Kernel layers replacing the model's `SiluAndMul` forward (`kernels` layer rules).

Stateless: no `__init__`, only `forward(self, x)` with x [..., 2I] -> [..., I]. The Triton
layers differ only in launch tuning; on CPU tensors they run the torch reference. A CPU
worker's `SiluAndMulCpu` runs the C++ kernel of cpu.py.
`COMPILE_SPECS` names, per Triton layer, the launches its forward can make (compiled ahead
of time by the preflight); each entry's tuning is the one its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .cpu import silu_and_mul_cpu
from .silu_and_mul import HOPPER, PRE_HOPPER, ROCM, compile_specs, silu_and_mul, silu_and_mul_reference


class SiluAndMul(nn.Module):
    """Torch reference (CUDA below sm_70; the CPU where the C++ kernel cannot build)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_reference(x)


class SiluAndMulCpu(nn.Module):
    """C++ on the CPU, one pass per row (cpu.py); the torch reference under torch.compile."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_cpu(x)


class SiluAndMulTritonSm70(nn.Module):
    """Triton, pre-Hopper tuning (sm_70..sm_89)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, PRE_HOPPER)


class SiluAndMulTritonSm90(nn.Module):
    """Triton, Hopper-and-later tuning (sm_90+)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, HOPPER)


class SiluAndMulTritonRocm(nn.Module):
    """Triton, ROCm tuning (64-lane wavefronts)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "SiluAndMulTritonSm70": partial(compile_specs, PRE_HOPPER),
    "SiluAndMulTritonSm90": partial(compile_specs, HOPPER),
    "SiluAndMulTritonRocm": partial(compile_specs, ROCM),
}
