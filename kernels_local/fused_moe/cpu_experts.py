"""The CPU experts' loop over their packed matrices in C++ (`cpu_experts.cpp`), built once per host.

Where a CPU worker packed the experts (torch_path.py `fused_moe_packed`), the Python between the
packed matmuls (slicing, padding, the activation's three ops and the copy out, per active expert)
cost a decode batch as much as the matmuls; the C++ loop runs the same ops, the pairs sorted,
gathered and summed in plain loops. Each expert's matrix is what the worker made of it
(workers/model/cpu_projections.py): a oneDNN pack, multiplied by oneDNN's packed matmul, or column
panels (kernels_local/panel_linear/cpu.py `panels`) multiplied by oneDNN's batch-reduce GEMM
(`cpublas::brgemm`) without the packed call's setup. Over packs its output is the Python loop's
bit for bit; over panels too on the shapes tests/test_cpu_experts.py checks. The trade-off: a
compiler on the host at first use (Inductor needs one anyway), and the panels' brgemm call written
here and in kernels_local/panel_linear/cpu_gemm.cpp alike, since a kernel repository imports no other.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels_local.cpp_build import DEFERRED, OPS, build, deferrable

logger = logging.getLogger(__name__)

ENV_CPU_EXPERTS = "HETSERVE_CPU_EXPERTS"  # "off": the Python loop only
SOURCE = Path(__file__).with_name("cpu_experts.cpp")
FLAGS = ("-O3", "-ffp-contract=off")  # no fused multiply-add: the weighted sum rounds as torch's mul and add


@dataclass(frozen=True)
class CpuExperts:
    """Whether the C++ loop is loaded in this process, and why (or why not)."""

    available: bool
    reason: str


_module = None


@deferrable
@functools.cache
def load() -> CpuExperts:
    """Build (once per host) and load the C++ loop; its state and reason. Never raises.

    Compiled with torch's C++ extension builder on first use in a process, into torch's extension
    cache under a name carrying a hash of the source and flags (kernels_local/cpp_build.py), so a
    later start only loads it. Without a C++ compiler, after a failed build or with
    `$HETSERVE_CPU_EXPERTS=off`, the Python loop serves (over oneDNN packs only). No vector flags:
    the products are oneDNN's, the loops around them move rows."""
    global _module
    if os.environ.get(ENV_CPU_EXPERTS, "").lower() in ("off", "0", "false"):
        return CpuExperts(False, f"${ENV_CPU_EXPERTS}=off: the packed experts run from a Python loop")
    _module, why = build("hetserve_cpu_experts", SOURCE, list(FLAGS), OPS)
    if why == DEFERRED:  # a worker serving first: built behind it, then loaded again
        return CpuExperts(False, f"{DEFERRED}; the packed experts run from Python meanwhile")
    if _module is None:  # no compiler, a failed build: the Python loop serves
        logger.warning("CPU experts loop unavailable (%s); the packed experts run from Python", why)
        return CpuExperts(False, f"C++ loop unavailable ({why.split(':')[0]}): the packed experts run from Python")
    return CpuExperts(True, "C++ loop over the packed experts")


def experts_packed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: tuple, down: tuple,
                   b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str, alpha: float,
                   limit: float, row_step: int) -> torch.Tensor:  # fmt: skip
    """`fused_moe_packed`'s sum by the C++ loop (`load()` must have found it): `x` [T, H] float32 or
    bfloat16, one oneDNN pack per expert in `gate_up` and `down` -> [T, H]."""
    return _module.experts_packed(x, topk_ids, topk_weights, list(gate_up), list(down), b_gate_up, b_down,
                                  activation, float(alpha), float(limit), int(row_step))  # fmt: skip
