"""The CPU experts' loop over their oneDNN packs in C++ (`cpu_experts.cpp`), built once per host.

Why: where a CPU worker packed the experts for oneDNN (torch_path.py `fused_moe_packed`), a
layer's time at a decode batch was the packed matmuls plus, as much again in float32 at 32
rows and 8 experts, the Python between them: slicing, padding, the activation's three ops and
the copy out, per active expert. The C++ loop runs the same ATen ops and the same oneDNN calls
(the output bit for bit the Python loop's, which tests/test_kernels_moe.py holds) with the pairs
sorted, gathered and summed in plain loops: about 0.7x the Python loop's time per layer at
32 rows (benchmarks/decode_vs_transformers.py times the whole step).

Design: compiled with torch's C++ extension builder on first use in a process, into torch's
extension cache under a name carrying a hash of the source and flags (a later start loads it in
well under a second); `load()` says whether it is there and why not (no C++ compiler, a failed
build: the Python loop serves); `$HETSERVE_CPU_EXPERTS=off` keeps the Python loop. No vector
flags: the products are oneDNN's, the loops around them move rows.
Trade-off: a compiler on the host at first use (Inductor needs one anyway) and 20-30 s for the
first build on 2 cores, against a Python loop whose cost grows with the active experts.
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


def products(w: torch.Tensor, attr: str) -> tuple[torch.Tensor, ...]:
    """The matrices the C++ loop multiplies by, one per expert of the stack `w` [E, N, K]: copies
    of its oneDNN packs (under `attr`) laid out for oneDNN's batch-reduce GEMM, [K, N] in float32
    and [K/2, N, 2] in bfloat16 (an even K), which replace the packs under `attr` on first use (the
    same products bit for bit, without a packed call's setup: 0.1-0.7x its time at 1 to 32 rows;
    the same bytes); the packs themselves where the layout cannot hold the matrix (an odd K)."""
    packs = getattr(w, attr)
    k = w.shape[-1]
    if packs[0].is_mkldnn and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and k % 2 == 0)):
        kn = torch.stack([p.to_dense().t() for p in packs])  # [E, K, N], from the packs themselves
        if w.dtype == torch.bfloat16:  # pairs of K side by side: [E, K/2, N, 2]
            kn = kn.view(kn.shape[0], k // 2, 2, kn.shape[-1]).transpose(2, 3)
        packs = tuple(kn.contiguous().unbind(0))
        setattr(w, attr, packs)
    return packs


def experts_packed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: tuple, down: tuple,
                   b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, activation: str, alpha: float,
                   limit: float, row_step: int) -> torch.Tensor:  # fmt: skip
    """`fused_moe_packed`'s sum by the C++ loop (`load()` must have found it): `x` [T, H] float32 or
    bfloat16, one oneDNN pack per expert in `gate_up` and `down` -> [T, H]."""
    return _module.experts_packed(x, topk_ids, topk_weights, list(gate_up), list(down), b_gate_up, b_down,
                                  activation, float(alpha), float(limit), int(row_step))  # fmt: skip
