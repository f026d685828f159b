"""Kernel layers replacing the model's `FusedMoE` forward (`kernels` layer rules).

Each layer is stateless: no `__init__`, only `forward(self, x, topk_ids, topk_weights)`, where
`self` is the model's `FusedMoE` (`w_gate_up` [E, 2I, H], `w_down` [E, H, I], biases `b_gate_up`
[E, 2I] and `b_down` [E, H] or None, `activation`, `alpha`, `limit`, `row_tile`), its
`Fp8FusedMoE` (a checkpoint's fp8 experts, fp8.py) or its `Mxfp4FusedMoE` (gpt-oss's MXFP4 experts
kept packed, mxfp4.py). The Triton layers differ only in their launch tuning and take the torch
path on CPU tensors; an fp8 or MXFP4 layer runs one execution and refuses a module prepared for
another, so a buffer made for one never reaches another's kernel. Deterministic mode (`row_tile`
set) takes the torch path in fixed row tiles (`_triton_or_torch`): the trade-off is one matmul per
tile. `COMPILE_SPECS` names, per Triton layer, the launches its forward can make (the preflight
compiles them ahead of time), each with the tuning its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .fp8 import fp8_compile_specs, fused_moe_fp8, fused_moe_fp8_reference
from .fused_moe import HOPPER, PRE_HOPPER, ROCM, FusedMoETuning, compile_specs, fused_moe
from .mxfp4 import fused_moe_mxfp4, fused_moe_mxfp4_reference, mxfp4_compile_specs
from .torch_path import fused_moe_reference, fused_moe_torch


def _torch_path(module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Deterministic mode: the reference in fixed row tiles; otherwise the grouped torch path."""
    tile = getattr(module, "row_tile", None)
    if tile is None:
        return fused_moe_torch(x, module.w_gate_up, module.w_down, topk_ids, topk_weights, module.b_gate_up,
                               module.b_down, module.activation, module.alpha, module.limit)  # fmt: skip
    return fused_moe_reference(x, module.w_gate_up, module.w_down, topk_ids, topk_weights, module.b_gate_up,
                               module.b_down, module.activation, module.alpha, module.limit, tile)  # fmt: skip


def _triton_or_torch(module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     tuning: FusedMoETuning) -> torch.Tensor:  # fmt: skip
    """The kernel, or in deterministic mode (`row_tile` set) the torch path in fixed tiles of
    `row_tile` rows per expert, as the CPU layer does: the kernel's tile shape follows the step's
    token count (decode or prefill shape) and a row's block mates are whatever other pairs chose
    its expert, so it cannot promise a row's bits whatever its batch; the fixed GEMM shape does."""
    if getattr(module, "row_tile", None) is not None:  # deterministic: fixed tiles
        return _torch_path(module, x, topk_ids, topk_weights)
    return fused_moe(x, module.w_gate_up, module.w_down, topk_ids, topk_weights, module.b_gate_up, module.b_down,
                     module.activation, module.alpha, module.limit, tuning=tuning)  # fmt: skip


class FusedMoE(nn.Module):
    """Torch (CPU): pairs grouped by expert, one grouped GEMM per projection (deterministic: the
    reference in row tiles)."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _torch_path(self, x, topk_ids, topk_weights)


class FusedMoETritonSm70(nn.Module):
    """Triton, pre-Hopper tuning (sm_70..sm_89): 16-row decode blocks, 64-row prefill blocks, 4 warps."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _triton_or_torch(self, x, topk_ids, topk_weights, PRE_HOPPER)


class FusedMoETritonSm90(nn.Module):
    """Triton, Hopper-and-later tuning (sm_90+): 64-row blocks or more (wgmma), 128 x 128 prefill tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _triton_or_torch(self, x, topk_ids, topk_weights, HOPPER)


class FusedMoETritonRocm(nn.Module):
    """Triton, ROCm tuning (64-lane wavefronts, 64 KiB of LDS, 2 stages)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _triton_or_torch(self, x, topk_ids, topk_weights, ROCM)


# -- pre-quantized checkpoints' fp8 experts (`Fp8FusedMoE`) -----------------------------------------


def _expect(module: nn.Module, execution: str) -> None:
    if module.execution != execution:
        raise TypeError(f"fp8 experts layer for the `{execution}` execution got a module prepared for "
                        f"`{module.execution}`")  # fmt: skip


def _fp8(module: nn.Module, x, topk_ids, topk_weights, execution: str, tuning: FusedMoETuning) -> torch.Tensor:
    _expect(module, execution)
    if getattr(module, "row_tile", None) is not None:  # deterministic: fixed tiles (`_triton_or_torch`)
        return fused_moe_fp8_reference(x, module, topk_ids, topk_weights, module.row_tile)
    return fused_moe_fp8(x, module, topk_ids, topk_weights, native=execution == "native", tuning=tuning)


class Fp8FusedMoE(nn.Module):
    """Torch (CPU, and CUDA below sm_80): the experts were dequantized at load; the torch grouping."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        _expect(self, "dequantized")
        return _torch_path(self, x, topk_ids, topk_weights)


class Fp8FusedMoETritonW8A16Sm80(nn.Module):
    """Triton weight-only (sm_80..sm_88): e4m3 bytes decoded in registers, 16-bit mma, pre-Hopper tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _fp8(self, x, topk_ids, topk_weights, "weight_only", PRE_HOPPER)


class Fp8FusedMoETritonW8A16Rocm(nn.Module):
    """Triton weight-only on ROCm archs without fp8 matrix cores (e4m3fnuz bytes, 16-bit MFMA)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _fp8(self, x, topk_ids, topk_weights, "weight_only", ROCM)


class Fp8FusedMoETritonNativeSm89(nn.Module):
    """Triton native (Ada, sm_89): fp8 operands on fp8 mma, pre-Hopper tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _fp8(self, x, topk_ids, topk_weights, "native", PRE_HOPPER)


class Fp8FusedMoETritonNativeSm90(nn.Module):
    """Triton native, Hopper-and-later tiles (sm_90+: 64-row blocks or more, wgmma)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _fp8(self, x, topk_ids, topk_weights, "native", HOPPER)


class Fp8FusedMoETritonNativeRocm(nn.Module):
    """Triton native on CDNA3 (e4m3fnuz, scales doubled) and CDNA4 (OCP e4m3fn) fp8 matrix cores."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _fp8(self, x, topk_ids, topk_weights, "native", ROCM)


# -- gpt-oss's MXFP4 experts kept packed (`Mxfp4FusedMoE`) ---------------------------------------------


def _mxfp4(module: nn.Module, x, topk_ids, topk_weights, tuning: FusedMoETuning | None) -> torch.Tensor:
    if getattr(module, "execution", None) != "w4a16":
        raise TypeError(f"MXFP4 experts layer for the `w4a16` execution got a module of "
                        f"`{getattr(module, 'execution', None)}`")  # fmt: skip
    if tuning is None or getattr(module, "row_tile", None) is not None:  # torch, or deterministic tiles
        return fused_moe_mxfp4_reference(x, module, topk_ids, topk_weights, getattr(module, "row_tile", None))
    return fused_moe_mxfp4(x, module, topk_ids, topk_weights, tuning=tuning)


class Mxfp4FusedMoE(nn.Module):
    """Torch: each active expert's e2m1 blocks dequantized per call into the activations' dtype. Only
    devices whose MXFP4 rule keeps the experts packed build an `Mxfp4FusedMoE` (the others widen them
    at load into `FusedMoE`)."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _mxfp4(self, x, topk_ids, topk_weights, None)


class Mxfp4FusedMoETritonSm80(nn.Module):
    """Triton W4A16 (Ampere/Ada, sm_80..sm_89): e2m1 decoded in registers, 16-bit mma, pre-Hopper tiles."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _mxfp4(self, x, topk_ids, topk_weights, PRE_HOPPER)


class Mxfp4FusedMoETritonSm90(nn.Module):
    """Triton W4A16, Hopper-and-later tiles (sm_90+: 64-row blocks or more, wgmma)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _mxfp4(self, x, topk_ids, topk_weights, HOPPER)


class Mxfp4FusedMoETritonRocm(nn.Module):
    """Triton W4A16 on ROCm (16-bit MFMA, 64-lane wavefronts, 2 stages)."""

    has_backward = False

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return _mxfp4(self, x, topk_ids, topk_weights, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "FusedMoETritonSm70": partial(compile_specs, PRE_HOPPER),
    "FusedMoETritonSm90": partial(compile_specs, HOPPER),
    "FusedMoETritonRocm": partial(compile_specs, ROCM),
    "Fp8FusedMoETritonW8A16Sm80": partial(fp8_compile_specs, PRE_HOPPER, native=False),
    "Fp8FusedMoETritonW8A16Rocm": partial(fp8_compile_specs, ROCM, native=False),
    "Fp8FusedMoETritonNativeSm89": partial(fp8_compile_specs, PRE_HOPPER, native=True),
    "Fp8FusedMoETritonNativeSm90": partial(fp8_compile_specs, HOPPER, native=True),
    "Fp8FusedMoETritonNativeRocm": partial(fp8_compile_specs, ROCM, native=True),
    "Mxfp4FusedMoETritonSm80": partial(mxfp4_compile_specs, PRE_HOPPER),
    "Mxfp4FusedMoETritonSm90": partial(mxfp4_compile_specs, HOPPER),
    "Mxfp4FusedMoETritonRocm": partial(mxfp4_compile_specs, ROCM),
}
