"""Kernel layers replacing the `Fp8Linear` forward of the worker's quantized model.

Stateless (`kernels` layer rules): only `forward(self, x)`, reading from the module it
replaces: `qweight` [N, K] (uint8 bytes when emulated, an fp8 tensor when native),
`weight_scale` [N] fp32, `bias` [N] or None, `fp8_native` (bool) and `fp8_fmt`
("e4m3fn" | "e4m3fnuz"). `fp8_native` and the buffer dtype were both set from the worker's
one fp8 convention; the Triton layers pass `fp8_native` as the kernel's `NATIVE` flag, and
each layer refuses a module of the other convention. `COMPILE_SPECS` names, per Triton
layer, the launches its forward can make (the preflight compiles them ahead of time), with
the tuning and `NATIVE` flag its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

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


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "Fp8LinearTritonEmulatedSm80": partial(compile_specs, SM80, native=False),
    "Fp8LinearTritonNativeSm89": partial(compile_specs, SM89, native=True),
    "Fp8LinearTritonNativeSm90": partial(compile_specs, SM90, native=True),
    "Fp8LinearTritonEmulatedRocm": partial(compile_specs, ROCM, native=False),
    "Fp8LinearTritonNativeRocm": partial(compile_specs, ROCM, native=True),
}
