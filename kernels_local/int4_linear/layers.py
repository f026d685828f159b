"""Kernel layers for a 4-bit checkpoint's linear layer: the W4A16 GEMM with each architecture's tuning.

Stateless (`kernels` layer rules): only `forward(self, x)`, reading from the module it replaces:
`execution` ("w4a16" | "packed" | "dequantized", set at load from the device's 4-bit rule), the
run-time layout of int4_linear.py (`qweight`, `scales`, `zeros`, `g_idx` or None, `group_size`, 0
per channel) and `bias`, or `weight` [N, K] when dequantized. Each layer runs its execution and
refuses a module loaded for another, except a module dequantized at load (the named fallback of a
layer the packed layout cannot hold, on any device), which every layer runs as a plain matmul. On
CPU tensors the Triton layers take the torch reference. `COMPILE_SPECS` names, per Triton layer,
the launches its forward can make with the tuning its forward passes. The trade-off: one kernel
and four tunings; a layer per tuning keeps the choice a kernel mapping entry, as for fp8.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .int4_linear import (
    ROCM,
    SM75,
    SM80,
    SM90,
    Int4LinearTuning,
    compile_specs,
    int4_linear,
    int4_linear_reference,
)


def _expect(module: nn.Module, execution: str) -> None:
    have = getattr(module, "execution", None)
    if have != execution:
        raise TypeError(f"int4 layer for the `{execution}` execution got a module loaded for `{have}`")


def _run(module: nn.Module, x: torch.Tensor, tuning: Int4LinearTuning) -> torch.Tensor:
    if module.execution == "dequantized":
        return torch.nn.functional.linear(x, module.weight, module.bias)
    _expect(module, "w4a16")
    return int4_linear(x, module.qweight, module.scales, module.zeros, module.g_idx, module.bias, module.group_size,
                       tuning=tuning)


class Int4CheckpointLinear(nn.Module):
    """Torch (CPU): the packed weights stay resident; each call dequantizes the layer (exact, in the
    scales' dtype) and runs an fp32 matmul: the reference, within fp32 summation order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.execution == "dequantized":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        _expect(self, "packed")
        return int4_linear_reference(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bias, self.group_size)


class Int4CheckpointLinearDequantized(nn.Module):
    """Torch (CUDA below sm_75): the weights were dequantized at load into the model dtype; a plain matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _expect(self, "dequantized")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Int4LinearTritonSm75(nn.Module):
    """Turing (sm_75): fp16 mma, two stages in 64 KB of shared memory."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM75)


class Int4LinearTritonSm80(nn.Module):
    """Ampere, Ada and consumer Blackwell (sm_80..sm_89, sm_120): 16-bit mma, three stages."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM80)


class Int4LinearTritonSm90(nn.Module):
    """Hopper and data-center Blackwell (sm_90, sm_100, sm_103): wider tiles, eight warps."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM90)


class Int4LinearTritonRocm(nn.Module):
    """CDNA (gfx90a, gfx942, gfx950): 16-bit MFMA, two stages."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "Int4LinearTritonSm75": partial(compile_specs, SM75),
    "Int4LinearTritonSm80": partial(compile_specs, SM80),
    "Int4LinearTritonSm90": partial(compile_specs, SM90),
    "Int4LinearTritonRocm": partial(compile_specs, ROCM),
}
