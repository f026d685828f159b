"""The CPU experts' loop over their packed matrices in C++ (`cpu_experts.cpp`), built once per host.

Why: where a CPU worker packed the experts for oneDNN (torch_path.py `fused_moe_packed`), a
layer's time at a decode batch was the packed matmuls plus, as much again in float32 at 32
rows and 8 experts, the Python between them: slicing, padding, the activation's three ops and
the copy out, per active expert. And each packed oneDNN call has a fixed setup of about 13 us on
this CPU, more than the product itself for an expert of a few rows. The C++ loop runs the same
ops with the pairs sorted, gathered and summed in plain loops, and multiplies through oneDNN's
batch-reduce GEMM kernel (torch's `cpublas::brgemm`), which has no per-call setup, on the
experts' matrices laid out as column panels (`panels`, made from the packs on first use in
place of them). Its output is the Python loop's bit for bit in float32 and bfloat16 on the
shapes tests/test_cpu_experts.py checks; a layer of the benchmark's Qwen3-MoE (8 experts, 32
rows) takes 0.3x the Python loop's time in float32 and 0.35x in bfloat16.

Design: compiled with torch's C++ extension builder on first use in a process, into torch's
extension cache under a name carrying a hash of the source and flags (a later start loads it in
well under a second); `load()` says whether it is there and why not (no C++ compiler, a failed
build: the Python loop serves); `$HETSERVE_CPU_EXPERTS=off` keeps the Python loop. No vector
flags: the products are oneDNN's, the loops around them move rows. A reduction past `MAX_K`
keeps the oneDNN packs (the panels have no K blocking, and lose to them there).
Trade-off: a compiler on the host at first use (Inductor needs one anyway) and 20-30 s for the
first build on 2 cores; the layout is this loop's own, so only it reads the experts' packs once
they are panels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


@functools.cache
def load() -> CpuExperts:
    """Build (once per host) and load the C++ loop; its state and reason. Never raises."""
    global _module
    if os.environ.get(ENV_CPU_EXPERTS, "").lower() in ("off", "0", "false"):
        return CpuExperts(False, f"${ENV_CPU_EXPERTS}=off: the packed experts run from a Python loop")
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
        _module = cpp_extension.load(f"hetserve_cpu_experts_{digest}", [str(SOURCE)], extra_cflags=list(FLAGS),
                                     verbose=False)  # fmt: skip
    except Exception as e:  # no compiler, a failed build: the Python loop serves
        logger.warning("CPU experts loop unavailable (%s: %s); the packed experts run from Python",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
        return CpuExperts(False, f"C++ loop unavailable ({type(e).__name__}): the packed experts run from Python")
    return CpuExperts(True, "C++ loop over the packed experts")


PANEL = 64  # columns per panel of the layout (`panels`, cpu_experts.cpp `kPanel`)
MAX_K = 2048  # past this reduction the panels lose to the packs (no K blocking): the packs stay


def panels(kn: torch.Tensor) -> torch.Tensor:
    """A [K, N] matrix laid out for the C++ loop's batch-reduce GEMM: column panels of `PANEL`
    (the last narrower) one after another, each [K, w] in float32 or [K/2, w, 2] in bfloat16 (pairs
    of K side by side); shaped [K, N] / [K/2, N, 2] over that order."""
    k, n = kn.shape
    parts = []
    for n0 in range(0, n, PANEL):
        part = kn[:, n0 : n0 + PANEL]  # [K, w]
        if kn.dtype == torch.bfloat16:
            part = part.reshape(k // 2, 2, -1).transpose(1, 2)  # [K/2, w, 2]
        parts.append(part.contiguous().flatten())
    flat = torch.cat(parts)
    return flat.view(k // 2, n, 2) if kn.dtype == torch.bfloat16 else flat.view(k, n)


def products(w: torch.Tensor, attr: str) -> tuple[torch.Tensor, ...]:
    """The matrices the C++ loop multiplies by, one per expert of the stack `w` [E, N, K]: its
    oneDNN packs (under `attr`), replaced there on first use by `panels` of them for oneDNN's
    batch-reduce GEMM where K is even (bfloat16) and at most `MAX_K` (0.2-0.95x a packed call's
    time at 1 to 128 rows on this CPU: no per-call setup; the same bytes)."""
    packs = getattr(w, attr)
    k = w.shape[-1]
    if packs[0].is_mkldnn and k <= MAX_K and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and k % 2 == 0)):
        packs = tuple(panels(p.to_dense().t()) for p in packs)  # from the packs themselves
        setattr(w, attr, packs)
    return packs


def experts_packed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: tuple, down: tuple,
                   b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str, alpha: float,
                   limit: float, row_step: int) -> torch.Tensor:  # fmt: skip
    """`fused_moe_packed`'s sum by the C++ loop (`load()` must have found it): `x` [T, H] float32 or
    bfloat16, one oneDNN pack per expert in `gate_up` and `down` -> [T, H]."""
    return _module.experts_packed(x, topk_ids, topk_weights, list(gate_up), list(down), b_gate_up, b_down,
                                  activation, float(alpha), float(limit), int(row_step))  # fmt: skip
