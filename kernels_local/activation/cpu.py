"""SiluAndMul's CPU kernel: one pass in C++ (`cpu_silu_and_mul.cpp`), built once per host.

The torch reference runs SiLU over the strided gate half into a new tensor and multiplies it with
the up half in a second pass; the kernel reads each row's gate and up once and writes the product
once. `silu_and_mul_cpu` takes it in eager mode for float32 and bfloat16 inputs; under
`torch.compile` (the compiled decode step, which Inductor fuses itself), for any other input and
where the kernel did not build it returns the reference (`KERNEL.load()` says why;
`$HETSERVE_CPU_ACTIVATION=off` keeps it). The math is the reference's, rounding for rounding (SiLU
rounded to the input's dtype before the product), with ATen's vectorized `exp` where ATen's loop
takes it. The trade-off: the outputs are the reference's bit for bit as ATen computes it on one
thread; on more, ATen splits a tensor at any element, which moves the few its scalar tail computes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_local.cpp_build import CppKernel

from .silu_and_mul import silu_and_mul_reference

ENV_CPU_ACTIVATION = "HETSERVE_CPU_ACTIVATION"  # "off": the torch reference only
KERNEL = CppKernel("hetserve_cpu_silu_and_mul", Path(__file__).with_name("cpu_silu_and_mul.cpp"), ENV_CPU_ACTIVATION,
                   "C++ kernel, one pass per row", ("-ffp-contract=off",))


def runs_cpp(x: torch.Tensor) -> bool:
    """Whether `silu_and_mul_cpu(x)` runs the kernel (else the reference)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % 2 == 0
            and x.numel() > 0 and not torch.compiler.is_compiling() and KERNEL.load().available)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_reference(x [..., 2I])` -> [..., I] by the kernel where it runs (`runs_cpp`)."""
    if not runs_cpp(x):
        return silu_and_mul_reference(x)
    rows = x.reshape(-1, x.shape[-1])  # [R, 2I]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return KERNEL.module.silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)
