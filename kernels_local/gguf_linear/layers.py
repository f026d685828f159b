"""Kernel layers for a GGUF linear layer (the blocks' GEMV / GEMM) and a MoE layer's GGUF experts (the
grouped GEMM, gguf_moe.py), with each architecture's tuning.

Stateless (`kernels` layer rules): only `forward(self, x)`, reading from the module it replaces:
`execution` ("packed" | "dequantized", set at load from the device's GGUF rule), and for packed the
GGUF tensor's bytes `qweight` (uint8 [N, K / QK * TYPE_SIZE]) with their type `gguf_type`, or
`weight` [N, K] when dequantized, and `bias`; `GGUFLinearCpu` also `activations` ("exact" or "int8",
set at load from the worker's `--gguf-activations`; absent: exact). The Triton layers refuse a
module loaded for another execution, except a module dequantized at load (the named fallback of a
tensor no kernel reads, on any device), which every layer runs as a plain matmul. On CPU tensors the
Triton layers take the torch reference; `GGUFLinearCpu` runs the C++ GEMV over the blocks (cpu.py).
`COMPILE_SPECS` names, per Triton layer, the launches its forward can make with the tuning its
forward passes. The experts' layers (`GGUFExperts*`) read the same way from the model's `GGUFExperts`:
`execution`; packed, `gate_qweight`, `up_qweight`, `down_qweight` (uint8 [E, rows, bytes]) of `types`
(gate, up, down), `activation`, and on the CPU `activations`; dequantized, `w_gate`, `w_up`, `w_down`.
The trade-off: one decoder and four tunings; a layer per tuning keeps the choice a kernel mapping
entry, as for the 4-bit layers.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .cpu import gguf_linear_cpu, runs_cpp
from .gguf_linear import ROCM, SM70, SM80, SM90, GGUFLinearTuning, compile_specs, gguf_linear
from .gguf_moe import (
    MOE_ROCM,
    MOE_SM70,
    MOE_SM80,
    MOE_SM90,
    GGUFMoETuning,
    gguf_moe,
    gguf_moe_experts,
    group_experts,
    moe_compile_specs,
)
from .reference import gguf_linear_reference


def _run(module: nn.Module, x: torch.Tensor, tuning: GGUFLinearTuning | None) -> torch.Tensor:
    execution = getattr(module, "execution", None)
    if execution == "dequantized":
        return torch.nn.functional.linear(x, module.weight, module.bias)
    if execution != "packed":
        raise TypeError(f"GGUF layer got a module loaded for `{execution}`; it runs `packed` or `dequantized`")
    if tuning is None:
        return gguf_linear_reference(x, module.qweight, module.gguf_type, module.bias)
    return gguf_linear(x, module.qweight, module.gguf_type, module.bias, tuning=tuning)


class GGUFLinear(nn.Module):
    """Torch (CPU, CUDA below sm_70): a plain matmul on weights dequantized at load; packed blocks
    (where a module holds them) are decoded per call by the reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, None)


class GGUFLinearCpu(nn.Module):
    """CPU: packed blocks of the C++ kernel's types through its GEMV (cpu.py; the int8 one where the
    module's `activations` say so); anything else as `GGUFLinear`."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "execution", None) == "packed" and runs_cpp(x, self.gguf_type):
            int8 = getattr(self, "activations", "exact") == "int8"
            return gguf_linear_cpu(x, self.qweight, self.gguf_type, self.bias, int8)
        return _run(self, x, None)


class GGUFLinearTritonSm70(nn.Module):
    """Volta and Turing (sm_70..sm_79): blocks decoded in registers, GEMM tiles of at most 32 rows."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM70)


class GGUFLinearTritonSm80(nn.Module):
    """Ampere and Ada (sm_80..sm_89): blocks decoded in registers, 64-row GEMM tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM80)


class GGUFLinearTritonSm90(nn.Module):
    """Hopper and Blackwell (sm_90, sm_100, sm_103, sm_120): wider GEMM tiles, eight warps."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, SM90)


class GGUFLinearTritonRocm(nn.Module):
    """CDNA (gfx90a, gfx942, gfx950): 64-lane wavefronts, two stages."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, ROCM)


def _dense(rows: torch.Tensor, w: torch.Tensor, _type: str) -> torch.Tensor:
    return torch.nn.functional.linear(rows, w.to(rows.dtype))


def run_experts(module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                tuning: GGUFMoETuning | None) -> torch.Tensor:  # fmt: skip
    """A `GGUFExperts` module's experts: dequantized, a matmul pair per active expert; packed, the grouped
    kernel with `tuning`, or with None the reference."""
    execution = getattr(module, "execution", None)
    if execution == "dequantized":
        return group_experts(x, module.w_gate, module.w_up, module.w_down, module.types, topk_ids, topk_weights,
                             module.activation, _dense)  # fmt: skip
    if execution != "packed":
        raise TypeError(f"GGUF experts layer got a module loaded for `{execution}`; it runs `packed` or `dequantized`")
    blocks = (module.gate_qweight, module.up_qweight, module.down_qweight, module.types, topk_ids, topk_weights)
    if tuning is None:
        return gguf_moe_experts(x, *blocks, module.activation)
    return gguf_moe(x, *blocks, module.activation, tuning=tuning)


class GGUFExperts(nn.Module):
    """Torch: a MoE layer's GGUF experts, one reference projection per active expert (dequantized: a
    matmul pair)."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, None)


class GGUFExpertsCpu(nn.Module):
    """CPU: each active expert's projections through the C++ GEMV over its blocks (the int8 one where
    `activations` say so), where the kernel reads all three types; else as `GGUFExperts`."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if getattr(self, "execution", None) == "packed" and all(runs_cpp(x, t) for t in self.types):
            int8 = getattr(self, "activations", "exact") == "int8"
            return gguf_moe_experts(x, self.gate_qweight, self.up_qweight, self.down_qweight, self.types, topk_ids,
                                    topk_weights, self.activation,
                                    lambda rows, q, type_name: gguf_linear_cpu(rows, q, type_name, None, int8))
        return run_experts(self, x, topk_ids, topk_weights, None)


class GGUFExpertsTritonSm70(nn.Module):
    """Volta and Turing (sm_70..sm_79): the grouped GEMM over the experts' blocks, 32 x 32 prefill tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, MOE_SM70)


class GGUFExpertsTritonSm80(nn.Module):
    """Ampere and Ada (sm_80..sm_89): the grouped GEMM, 64 x 32 prefill tiles over 8 warps."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, MOE_SM80)


class GGUFExpertsTritonSm90(nn.Module):
    """Hopper and Blackwell: the grouped GEMM, 16 x 32 prefill tiles over 8 warps (wider ones spill)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, MOE_SM90)


class GGUFExpertsTritonRocm(nn.Module):
    """CDNA: the grouped GEMM, 64 x 64 prefill tiles over 4 wavefronts of 64 lanes."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, MOE_ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "GGUFLinearTritonSm70": partial(compile_specs, SM70),
    "GGUFLinearTritonSm80": partial(compile_specs, SM80),
    "GGUFLinearTritonSm90": partial(compile_specs, SM90),
    "GGUFLinearTritonRocm": partial(compile_specs, ROCM),
    "GGUFExpertsTritonSm70": partial(moe_compile_specs, MOE_SM70),
    "GGUFExpertsTritonSm80": partial(moe_compile_specs, MOE_SM80),
    "GGUFExpertsTritonSm90": partial(moe_compile_specs, MOE_SM90),
    "GGUFExpertsTritonRocm": partial(moe_compile_specs, MOE_ROCM),
}
