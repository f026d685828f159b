"""A CPU projection without oneDNN's per-call setup: brgemm over the weight's column panels (C++).

A packed oneDNN matmul (workers/model/cpu_projections.py) sets itself up on every call, which can
outweigh a small model's projection at a decode batch; oneDNN's batch-reduce GEMM kernel, which
torch exports (`at::native::cpublas::brgemm`), is looked up per shape without that setup.
`panels(weight)` lays a weight out once as contiguous column panels; `linear` multiplies over
them (cpu_gemm.cpp, built once per host by kernels_local/cpp_build.py; without it the packs serve).
The trade-off: a second kernel family beside the packs, chosen by the reduction's length (up to
`MAX_K`; without K blocking the packs win past it), and a layout only this module reads; the same
bytes as the packs they replace. Timings: docs/benchmarks.md "CPU projections".
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels_local.cpp_build import DEFERRED, OPS, build, cpu_flags, deferrable, vector_flags

logger = logging.getLogger(__name__)

ENV_CPU_GEMM = "HETSERVE_CPU_GEMM"  # "off": the oneDNN packs only
SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
PANEL = 64  # columns per panel (cpu_gemm.cpp `kPanel`)
MAX_K = 2048  # past this reduction the packs win (the panels have no K blocking)
# where a weight's layout is kept: its oneDNN pack or its `panels` (workers/model/cpu_projections.py sets it)
PACKED_ATTR = "_hetserve_onednn"


@dataclass(frozen=True)
class CpuGemm:
    """Whether the panel GEMM is loaded in this process, and why (or why not)."""

    available: bool
    reason: str


def _fake(rows: torch.Tensor, layout: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], layout.shape[1])  # [R, N]: panels are [K, N] or [K/2, N, 2]


@deferrable
@functools.cache
def load() -> CpuGemm:
    """Build (once per host) and load the panel GEMM; its state and reason. Never raises."""
    if os.environ.get(ENV_CPU_GEMM, "").lower() in ("off", "0", "false"):
        return CpuGemm(False, f"${ENV_CPU_GEMM}=off: projections through the oneDNN packs")
    flags = [*vector_flags(cpu_flags() or frozenset())[0], "-fopenmp"]  # at::parallel_for over OpenMP, as torch is
    module, why = build("hetserve_cpu_gemm", SOURCE, flags, OPS, {"panel_linear": _fake})
    if why == DEFERRED:  # a worker serving first: built behind it, then loaded again
        return CpuGemm(False, f"{DEFERRED}; projections through the oneDNN packs meanwhile")
    if module is None:
        logger.warning("CPU panel GEMM unavailable (%s); projections through the oneDNN packs", why)
        return CpuGemm(False, f"panel GEMM unavailable ({why.split(':')[0]}): projections through the oneDNN packs")
    return CpuGemm(True, f"brgemm over column panels for reductions up to {MAX_K}, oneDNN packs past it")


def fits(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can be laid out as panels: float32, or bfloat16 with an even K; K at most `MAX_K`."""
    k = weight.shape[-1]
    return k <= MAX_K and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and k % 2 == 0))


def panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as [K, N] column panels of `PANEL` (the last narrower) one after another, each
    [K, w] in float32 or [K/2, w, 2] in bfloat16 (pairs of K side by side: the order the bfloat16 dot
    instructions read; an even K); shaped [K, N] / [K/2, N, 2] over that order."""
    kn = weight.detach().t()  # [K, N]
    k, n = kn.shape
    parts = []
    for n0 in range(0, n, PANEL):
        part = kn[:, n0 : n0 + PANEL]  # [K, w]
        if kn.dtype == torch.bfloat16:
            part = part.reshape(k // 2, 2, -1).transpose(1, 2)  # [K/2, w, 2]
        parts.append(part.contiguous().flatten())
    flat = torch.cat(parts)
    return flat.view(k // 2, n, 2) if kn.dtype == torch.bfloat16 else flat.view(k, n)


def is_panels(pack: torch.Tensor) -> bool:
    """Whether a weight's pack is `panels`' layout (else a oneDNN pack)."""
    return not pack.is_mkldnn


def linear(rows: torch.Tensor, layout: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [R, K] @ weight.T + bias through the weight's `panels` -> [R, N] in the rows' dtype.

    The products are float32 sums, the bias added to them and a bfloat16 output rounded once, as the
    packed matmul does, one [64, 64] tile at a time while it is in cache. The order of the sums is
    the kernel's own, so results may differ from the packs' in the last bit where oneDNN splits a
    reduction otherwise (tests/test_cpu_gemm.py). From 256 rows (a prompt's, never a decode step's)
    the row blocks are shared among torch's intra-op threads (`at::parallel_for`, built with OpenMP
    as torch is): each output element is still one kernel's sum, so the bits do not depend on the
    thread count. One C++ operator, eager or inside a compiled step (its shape rule registered at
    load)."""
    return torch.ops.hetserve_cpu.panel_linear(rows, layout, bias)


def panel_linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x [..., K], weight, bias)` through the panels kept on `weight` (`PACKED_ATTR`) where
    it has them in `x`'s dtype and the kernel is loaded, eagerly; `F.linear` otherwise."""
    layout = getattr(weight, PACKED_ATTR, None)
    if (not isinstance(layout, torch.Tensor) or not is_panels(layout) or layout.dtype != x.dtype
            or x.device.type != "cpu" or torch.compiler.is_compiling() or not load().available):
        return F.linear(x, weight, bias)
    out = linear(x.reshape(-1, x.shape[-1]), layout, bias)  # [R, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])
