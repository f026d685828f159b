"""SiluAndMul's CPU kernel: one pass in C++ (`cpu_silu_and_mul.cpp`), built once per host.

Why: the torch reference runs SiLU over the strided gate half into a new tensor and multiplies it
with the up half in a second pass; at a prompt's rows ([2048, 1376] -> [2048, 688] for a burst of
16 prompts of 128 tokens through the embedded model) the two took an eighth of the prefill step on
one CPU thread. The kernel reads each row's gate and up once and writes the product once.

Design: `silu_and_mul_cpu` takes the kernel in eager mode for float32 and bfloat16 inputs; under
`torch.compile` (the worker's compiled decode step) it returns the torch reference, which Inductor
fuses itself, and so it does for any other input or where the kernel did not build
(`KERNEL.load()` says why; `$HETSERVE_CPU_ACTIVATION=off` keeps the reference). The math is the
reference's, rounding for rounding (SiLU rounded to the input's dtype before the product), with
ATen's own vectorized `exp` where ATen's loop takes it: the outputs are the reference's bit for bit
as ATen computes it on one thread (on more, ATen splits a tensor at any element, which moves the
few elements its scalar tail computes).
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
