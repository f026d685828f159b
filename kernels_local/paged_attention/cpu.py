"""Decode attention on the CPU, in place through the block table: a small C++ kernel.

In torch, attending the decode rows over the paged pool starts with a gather (every attended
position of every row copied out of its block, per layer and step), which a compiled step then
widens to fp32 for its batched matmuls. The kernel (`cpu_decode.cpp`) reads each row's blocks
where they lie and keeps a running softmax in fp32, as the GPU kernels do, so nothing is copied:
the contiguous mirror (workers/kv/mirror.py) and the compiled step's gather are not needed where
it runs. It is one C++ operator, `hetserve_cpu::paged_decode`, with its shape rule registered at
load, so a compiled step calls it as it is (no Python custom op's dispatch between),
built once per host for its vector ISA (kernels_local/cpp_build.py). The trade-off: a compiler on
the host at first use (Inductor needs one anyway) and a kernel of our own to keep equal to the
torch path (workers/kv/paged.py `PagedRows.attend`), the reference the tests hold it to.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels_local.cpp_build import DEFERRED, OPS, build, cpu_flags, deferrable, vector_flags

logger = logging.getLogger(__name__)

ENV_CPU_DECODE = "HETSERVE_CPU_DECODE"  # "off": the torch path only
SOURCE = Path(__file__).with_name("cpu_decode.cpp")


@dataclass(frozen=True)
class CpuDecode:
    """Whether the kernel is loaded in this process, and why (or why not)."""

    available: bool
    reason: str


def _flags() -> tuple[list[str], str]:
    """The compiler flags for this CPU's vector instructions and their name (`scalar` without any)."""
    return vector_flags(cpu_flags() or frozenset())


@deferrable
@functools.cache
def load() -> CpuDecode:
    """Build (once per host) and load the kernel; its state and reason. Never raises.

    Compiled with torch's C++ extension builder for this CPU's vector instructions (AVX-512 or AVX2,
    from its flags, as Inductor builds its own) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`,
    under a name carrying a hash of the source and the flags), on first use in a process; later
    starts only load it. Without a C++ compiler, after a failed build or with
    `$HETSERVE_CPU_DECODE=off`, the torch path serves and the reason says why. The package's
    `layers` does not import this module: `kernels` imports a repository under a name of its own,
    and the op registers once per process (the worker imports `kernels_local.paged_attention.cpu`)."""
    if os.environ.get(ENV_CPU_DECODE, "").lower() in ("off", "0", "false"):
        return CpuDecode(False, f"${ENV_CPU_DECODE}=off: decode attention gathers the rows' K/V in torch")
    flags, isa = _flags()
    module, why = build("hetserve_cpu_decode", SOURCE, flags, OPS, {"paged_decode": _fake})
    if why == DEFERRED:  # a worker serving first: built behind it, then loaded again
        return CpuDecode(False, f"{DEFERRED}; decode attention gathers in torch meanwhile")
    if module is None:  # no compiler, a failed build: the torch path serves
        logger.warning("CPU decode kernel unavailable (%s); decode attention gathers in torch", why)
        return CpuDecode(False, f"C++ kernel unavailable ({why.split(':')[0]}): decode attention gathers in torch")
    return CpuDecode(True, f"C++ kernel ({isa}): decode rows read their blocks in place, softmax in fp32")


def _fake(query, kv, tables, lens, window, scale, softcap, sinks):
    return torch.empty_like(query)  # [N, Hq, D]


def paged_decode_cpu(query: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, window: int,
                     scale: float, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query token per row: `query` [N, Hq, D] over the pool layer
    `kv` [2, Hkv, NB, B, D] through `tables` [N, W], row n attending positions `< lens[n]` (its last
    `window` when > 0), scores soft-capped when `softcap` > 0, `sinks` [Hq] joining each softmax;
    -> [N, Hq, D]. Scores, soft-cap, window, sinks and softmax follow the worker's torch path. A
    `RuntimeError` naming why where the kernel cannot load (`load()`); eager or inside a compiled step."""
    if not torch.compiler.is_compiling():  # a compiled step attends in place only where `in_place` said so
        state = load()
        if not state.available:
            raise RuntimeError(f"The CPU decode kernel is not available: {state.reason}")
    return torch.ops.hetserve_cpu.paged_decode(query, kv, tables, lens, window, scale, softcap, sinks)


def attend_in_place(rows, query: torch.Tensor, kv: torch.Tensor, window: int | None = None,
                    softcap: float | None = None, scale: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`DecodeRows.attend` by the kernel: `rows`' block tables and lengths, the layer's options."""
    return paged_decode_cpu(query, kv, rows.block_tables, rows.seq_lens, window or 0,
                            query.shape[-1] ** -0.5 if scale is None else scale, softcap or 0.0, sinks)


def in_place(device: torch.device | str) -> bool:
    """Whether decode rows on `device` attend through the kernel: a CPU, with the kernel loaded."""
    return torch.device(device).type == "cpu" and load().available
