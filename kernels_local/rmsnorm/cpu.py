"""RMSNorm's CPU kernel: one pass per row in C++ (`cpu_rmsnorm.cpp`), built once per host.

The torch reference is seven elementwise passes over its input, each through memory; the kernel
reads a row once, sums its squares in float32 vectors and writes the normalized, rounded and
scaled row while it is in cache. `rms_norm_cpu` takes it in eager mode for float32 and bfloat16
inputs whose weight has their dtype; under `torch.compile` (the compiled decode step, which
Inductor fuses itself), for any other input and where the kernel did not build it returns the
reference (`KERNEL.load()` says why; `$HETSERVE_CPU_RMSNORM=off` keeps it). The trade-off: the sum
of squares is the kernel's own order, so a row's variance may differ from the reference's in its
last float32 bit (and the output by one bfloat16 step where that bit decides a rounding).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_local.cpp_build import CppKernel

from .rmsnorm import rms_norm_reference

ENV_CPU_RMSNORM = "HETSERVE_CPU_RMSNORM"  # "off": the torch reference only
KERNEL = CppKernel("hetserve_cpu_rmsnorm", Path(__file__).with_name("cpu_rmsnorm.cpp"), ENV_CPU_RMSNORM,
                   "C++ kernel, one pass per row", ("-ffp-contract=off",))


def runs_cpp(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_cpu(x, weight, ...)` runs the kernel (else the reference)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and x.numel() > 0 and not torch.compiler.is_compiling() and KERNEL.load().available)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference(x [..., H], weight [H], eps)` by the kernel where it runs (`runs_cpp`)."""
    if not runs_cpp(x, weight):
        return rms_norm_reference(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])  # [R, H]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return KERNEL.module.rms_norm(rows, weight.contiguous(), float(eps)).view(x.shape)
