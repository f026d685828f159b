"""Kernel layers replacing the `Fp8Linear` forward of the worker's quantized model.

Stateless (`kernels` layer rules): only `forward(self, x)`, reading from the module it
replaces: `qweight` [N, K] (uint8 bytes when emulated, an fp8 tensor when native),
`weight_scale` [N] fp32, `bias` [N] or None, `fp8_native` (bool) and `fp8_fmt`
("e4m3fn" | "e4m3fnuz"). `fp8_native` and the buffer dtype were both set from the worker's
one fp8 convention; the Triton layers pass `fp8_native` as the kernel's `NATIVE` flag, and
each layer refuses a module of the other convention. The `Fp8CheckpointLinear` layers run a
pre-quantized checkpoint's layers (checkpoint.py), one execution each. `COMPILE_SPECS` names, per
Triton layer, the launches its forward can make (the preflight compiles them ahead of time), with
the tuning and `NATIVE` flag its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .checkpoint import w8a8_linear, w8a8_specs, w8a16_linear, w8a16_specs
from .fp8_linear import (
    ROCM,
    SM80,
    SM89,
    SM90,
    Fp8LinearTuning,
    check_weight,
    compile_specs,
    fp8_linear,
    fp8_linear_reference,
    scaled_mm_cpu,
)


def _run(module: nn.Module, x: torch.Tensor, expect_native: bool, tuning: Fp8LinearTuning) -> torch.Tensor:
    if bool(module.fp8_native) != expect_native:
        want = "native" if expect_native else "emulated"
        have = "native" if module.fp8_native else "emulated"
        raise TypeError(f"fp8 layer for the `{want}` convention got a module quantized as `{have}`")
    return fp8_linear(
        x,
        module.qweight,
        module.weight_scale,
        module.bias,
        native=expect_native,
        fmt=module.fp8_fmt,
        tuning=tuning,
    )


class Fp8Linear(nn.Module):
    """Torch (CPU, and GPUs below Triton's tensor-core floor): dequantize, then matmul.
    A native-convention module on CPU runs `torch._scaled_mm` (same bits)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_weight(self.qweight, bool(self.fp8_native), self.fp8_fmt)
        if self.fp8_native and self.fp8_fmt == "e4m3fn" and not x.is_cuda:
            return scaled_mm_cpu(x, self.qweight, self.weight_scale, self.bias, self.fp8_fmt)
        return fp8_linear_reference(x, self.qweight, self.weight_scale, self.bias, self.fp8_fmt)


class Fp8LinearTritonEmulatedSm80(nn.Module):
    """Triton, emulated (NATIVE=False): uint8 weights decoded in registers, fp16 mma (sm_80..sm_88)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, False, SM80)


class Fp8LinearTritonNativeSm89(nn.Module):
    """Triton, native e4m3 (NATIVE=True) on Ada's fp8 mma (sm_89)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, True, SM89)


class Fp8LinearTritonNativeSm90(nn.Module):
    """Triton, native e4m3 (NATIVE=True), Hopper-and-later tiles (sm_90+)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, True, SM90)


class Fp8LinearTritonEmulatedRocm(nn.Module):
    """Triton, emulated e4m3fnuz on ROCm archs without fp8 matrix cores."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, False, ROCM)


class Fp8LinearTritonNativeRocm(nn.Module):
    """Triton, native e4m3fnuz on CDNA3+ fp8 matrix cores."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self, x, True, ROCM)


# -- pre-quantized checkpoints (`Fp8CheckpointLinear`) -------------------------------------------
#
# The module reads `execution` ("native" | "weight_only" | "dequantized", set by the worker's fp8
# step from the one fp8 rule), `qweight`, `weight_scale`, `group_n`, `group_k`, `activations`,
# `input_scale`, `fp8_fmt`, `bias`, and `weight` when dequantized. Each layer runs one execution and
# refuses a module prepared for another.


def _expect(module: nn.Module, execution: str) -> None:
    if module.execution != execution:
        raise TypeError(f"fp8 checkpoint layer for the `{execution}` execution got a module prepared for "
                        f"`{module.execution}`")  # fmt: skip


def _native(module: nn.Module, x: torch.Tensor, tuning: Fp8LinearTuning) -> torch.Tensor:
    _expect(module, "native")
    return w8a8_linear(x, module.qweight, module.weight_scale, module.group_n, module.group_k, module.input_scale,
                       module.activations, module.bias, fmt=module.fp8_fmt, tuning=tuning)  # fmt: skip


def _weight_only(module: nn.Module, x: torch.Tensor, tuning: Fp8LinearTuning) -> torch.Tensor:
    _expect(module, "weight_only")
    return w8a16_linear(x, module.qweight, module.weight_scale, module.group_n, module.group_k, module.bias,
                        fmt=module.fp8_fmt, tuning=tuning)  # fmt: skip


class Fp8CheckpointLinear(nn.Module):
    """Torch (CPU, and CUDA below sm_80): the weights were dequantized at load; a plain matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _expect(self, "dequantized")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Fp8CheckpointLinearTritonW8A16Sm80(nn.Module):
    """Triton weight-only (sm_80..sm_88): uint8 bytes decoded in registers, 16-bit mma, fp32 accumulation."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _weight_only(self, x, SM80)


class Fp8CheckpointLinearTritonW8A16Rocm(nn.Module):
    """Triton weight-only on ROCm archs without fp8 matrix cores (e4m3fnuz bytes, 16-bit MFMA)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _weight_only(self, x, ROCM)


class Fp8CheckpointLinearTritonNativeSm89(nn.Module):
    """Triton native (Ada, sm_89): per-channel GEMM or the block-scaled GEMM on fp8 mma."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _native(self, x, SM89)


class Fp8CheckpointLinearTritonNativeSm90(nn.Module):
    """Triton native, Hopper-and-later tiles (sm_90+, wgmma / tcgen05)."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _native(self, x, SM90)


class Fp8CheckpointLinearTritonNativeRocm(nn.Module):
    """Triton native on CDNA3 (e4m3fnuz, scales doubled) and CDNA4 (OCP e4m3fn) fp8 matrix cores."""

    has_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _native(self, x, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "Fp8LinearTritonEmulatedSm80": partial(compile_specs, SM80, native=False),
    "Fp8LinearTritonNativeSm89": partial(compile_specs, SM89, native=True),
    "Fp8LinearTritonNativeSm90": partial(compile_specs, SM90, native=True),
    "Fp8LinearTritonEmulatedRocm": partial(compile_specs, ROCM, native=False),
    "Fp8LinearTritonNativeRocm": partial(compile_specs, ROCM, native=True),
    "Fp8CheckpointLinearTritonW8A16Sm80": partial(w8a16_specs, SM80),
    "Fp8CheckpointLinearTritonW8A16Rocm": partial(w8a16_specs, ROCM),
    "Fp8CheckpointLinearTritonNativeSm89": partial(w8a8_specs, SM89),
    "Fp8CheckpointLinearTritonNativeSm90": partial(w8a8_specs, SM90),
    "Fp8CheckpointLinearTritonNativeRocm": partial(w8a8_specs, ROCM),
}
