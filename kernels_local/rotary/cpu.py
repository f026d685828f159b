"""The rotary embedding on the CPU in one pass: C++ (`cpu_rotary.cpp`), built once per host.

`apply_rotary`'s torch form is seven elementwise passes (four products, a difference, a sum and a
concatenation) over a step's queries and keys; the kernel reads each token's heads once and writes
the rotated heads once. `rotate` is `apply_rotary`'s fast path (workers/model/rope.py) for an eager
step's packed tokens in float32 or bfloat16; anything else, everything under `torch.compile`
(Inductor fuses the torch form itself) and a host where the kernel did not build take the torch
form (rotary.py; `rotary_cpu` chooses, `$HETSERVE_CPU_ROTARY=off` keeps the torch form). Each
product, the difference and the sum round to the input's dtype as the torch form's ops do, so the
two agree bit for bit (tests/test_cpu_elementwise.py). The trade-off: one more C++ build on a
host's first start.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_local.cpp_build import CppKernel

from .rotary import rotary_reference

ENV_CPU_ROTARY = "HETSERVE_CPU_ROTARY"  # "off": the torch form only
KERNEL = CppKernel("hetserve_cpu_rotary", Path(__file__).with_name("cpu_rotary.cpp"), ENV_CPU_ROTARY,
                   "C++ rotary, one pass per token", ("-ffp-contract=off",))


def runs(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `apply_rotary(x, cos, ...)` takes the kernel."""
    return (x.device.type == "cpu" and x.dim() == 3 and cos.dim() == 3 and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == x.dtype and x.shape[0] == cos.shape[0] and x.stride(-1) == 1 and x.numel() > 0
            and not torch.compiler.is_compiling() and KERNEL.load().available)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos, sin [T, 1, R/2] over its first R dims -> [T, heads, D] (`runs` must hold)."""
    return KERNEL.module.rotary(x, cos.contiguous(), sin.contiguous())


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary_reference(x, cos, sin)` by the kernel where it runs (`runs`)."""
    return rotate(x, cos, sin) if runs(x, cos) else rotary_reference(x, cos, sin)
