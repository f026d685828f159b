"""Greedy rows on the CPU in C++ (`cpu_greedy.cpp`): each row's token and logprob, no [N, V] logprobs.

For a step's greedy rows the torch form takes log_softmax over the whole vocabulary, then ATen's
argmax (a scalar loop on the CPU) over that output, then a gather. The kernel takes each row's max
and sum of exponentials with ATen's own vectorized reductions, so its logprobs are the ones
log_softmax writes, bit for bit, and finds the first index of the greatest in vectors, as ATen's
argmax picks it (the lowest index among equals, a NaN above every number). The sampler
(workers/sampling/sampler.py) takes it only when every row of the step is greedy and none asks for
alternatives, which read the whole logprobs; `greedy_rows` falls back to the torch reference
(greedy.py) where `runs` says no (`$HETSERVE_CPU_GREEDY=off` keeps it). The trade-off: a C++ build
on a host's first start, for the same tokens and logprobs either way (tests/test_sampling.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_local.cpp_build import CppKernel

from .greedy import greedy_reference

ENV_CPU_GREEDY = "HETSERVE_CPU_GREEDY"  # "off": the torch form only
KERNEL = CppKernel("hetserve_cpu_greedy", Path(__file__).with_name("cpu_greedy.cpp"), ENV_CPU_GREEDY,
                   "C++ greedy rows, no [N, V] logprobs")


def runs(logits: torch.Tensor) -> bool:
    """Whether `greedy(logits)` may run: float32 [N, V] CPU logits, eager, the kernel loaded."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[-1] > 0 and not torch.compiler.is_compiling() and KERNEL.load().available)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(logits).argmax(-1)` and those logprobs: (ids [N] int64, logprobs [N] float32)."""
    rows = logits if logits.stride(-1) == 1 else logits.contiguous()
    return KERNEL.module.greedy(rows)


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_reference(logits)` by the kernel where it runs (`runs`)."""
    return greedy(logits) if runs(logits) else greedy_reference(logits)
