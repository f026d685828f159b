"""Kernel layers for the LoRA delta of a mixed batch: the segmented shrink/expand with each architecture's
tuning.

Stateless (`kernels` layer rules): only `forward(self, name, x, out, batch)`, the signature of the
worker's `LoraDelta` it replaces, reading from that module: `torch_delta(name, x, out, batch)` (the
torch path, the reference) and `stacked(name, batch, device)`, which returns this projection's
`LoraStack` and the batch's `LoraSegments` (None when no adapter of the batch targets it). On CPU
tensors (a CPU or simulated worker) every layer takes the torch path. `COMPILE_SPECS` names, per
Triton layer, the launches its forward can make with the tuning it passes. Trade-off: the stacks
are the worker's to build and keep (it knows the adapters); the repository knows only tensors.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .lora_sgmv import ROCM, SM70, SM90, LoraTuning, compile_specs, lora_sgmv, runs_triton


def _run(module: nn.Module, name: str, x: torch.Tensor, out: torch.Tensor, batch, tuning: LoraTuning) -> None:
    if not runs_triton(x):
        return module.torch_delta(name, x, out, batch)
    packed = module.stacked(name, batch, x.device)
    if packed is not None:
        lora_sgmv(x, out, *packed, tuning=tuning)
    return None


class LoraDelta(nn.Module):
    """Torch (CPU, and CUDA below sm_70): one gather, two matmuls and a scatter per adapter present."""

    def forward(self, name: str, x: torch.Tensor, out: torch.Tensor, batch) -> None:
        return self.torch_delta(name, x, out, batch)


class LoraDeltaTritonSm70(nn.Module):
    """Volta to Ada (sm_70..sm_89): 32-wide K blocks, 64 columns, segment tiles up to 32 rows."""

    has_backward = False

    def forward(self, name: str, x: torch.Tensor, out: torch.Tensor, batch) -> None:
        return _run(self, name, x, out, batch, SM70)


class LoraDeltaTritonSm90(nn.Module):
    """Hopper and newer (sm_90+): 64-wide K blocks, 128 columns, segment tiles up to 64 rows, 8 warps."""

    has_backward = False

    def forward(self, name: str, x: torch.Tensor, out: torch.Tensor, batch) -> None:
        return _run(self, name, x, out, batch, SM90)


class LoraDeltaTritonRocm(nn.Module):
    """CDNA and RDNA: 32-wide K blocks, two stages."""

    has_backward = False

    def forward(self, name: str, x: torch.Tensor, out: torch.Tensor, batch) -> None:
        return _run(self, name, x, out, batch, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "LoraDeltaTritonSm70": partial(compile_specs, SM70),
    "LoraDeltaTritonSm90": partial(compile_specs, SM90),
    "LoraDeltaTritonRocm": partial(compile_specs, ROCM),
}
