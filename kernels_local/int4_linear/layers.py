"""Kernel layers for a 4-bit checkpoint's linear layer: the W4A16 GEMM with each architecture's tuning.

Stateless (`kernels` layer rules): only `forward(self, x)`, reading from the module it replaces:
`qweight` int32 [ceil(K/8), N] (the run-time layout of int4_linear.py), `scales` [G, N] in the
checkpoint's dtype, `zeros` [G, N] int8, `g_idx` [K] int32 or None (act-order), `group_size` (0 per
channel) and `bias` [N] or None. On CPU tensors each layer takes the torch reference. `COMPILE_SPECS`
names, per Triton layer, the launches its forward can make (the preflight compiles them ahead of
time) with the tuning its forward passes. The trade-off: one kernel and four tunings; a layer per
tuning keeps the choice a kernel mapping entry, as for the fp8 layers.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .int4_linear import ROCM, SM75, SM80, SM90, Int4LinearTuning, compile_specs, int4_linear


def _run(module: nn.Module, x: torch.Tensor, tuning: Int4LinearTuning) -> torch.Tensor:
    return int4_linear(x, module.qweight, module.scales, module.zeros, module.g_idx, module.bias, module.group_size,
                       tuning=tuning)


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
