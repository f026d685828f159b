"""One thread computes: the OpenMP pools of the worker's other threads given back once they are done.

torch's CPU operators, Inductor's kernels and the C++ kernels of kernels_local run their parallel
regions on the OpenMP runtime torch loads (libgomp in torch's Linux wheels). The runtime keeps a
pool of threads for every thread that has started a region, for that thread's whole life. Once all
the pools' threads outnumber the CPUs, its threads stop spinning between regions: each region then
wakes them through the kernel and waits for them, tens of microseconds each, and a decode step is a
few hundred regions. A worker loads, self-tests and warms its model on its main thread (a CPU
worker's compile runs on a thread of its own), and steps on the engine thread: three pools where
one computes.
`release_pool()` gives the calling thread's pool back (OpenMP 5.0's `omp_pause_resource_all`). The
main thread calls it once it only serves, a compile thread once it is done, and `pool_released()`
wraps the compute other threads do while serving (a short prompt's first step on the thread that
submits it, a request's embeddings). The trade-off: the next region on such a thread builds its pool
again (a thread's start, tens of microseconds); the engine's pool is untouched.
Figures: docs/benchmarks.md "One OpenMP pool".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

RUNTIMES = ("libgomp", "libomp", "libiomp5")  # GNU's, LLVM's and Intel's OpenMP runtimes
OMP_PAUSE_SOFT = 1  # `omp_pause_soft`: threads released, the runtime's state kept


def loaded_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """The paths of the OpenMP runtimes loaded into this process (from `maps`), in load order."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths: list[str] = []
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if os.path.basename(path).startswith(RUNTIMES) and ".so" in path and path not in paths:
            paths.append(path)
    return paths


@functools.cache
def _pause_functions() -> tuple[list, str]:
    """(each loaded runtime's `omp_pause_resource_all`, why there is none where the list is empty)."""
    import torch  # noqa: F401  (loads the runtime torch computes with)

    paths = loaded_runtimes()
    if not paths:
        return [], "no OpenMP runtime is loaded in this process"
    found = []
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        found.append(fn)
    if not found:
        return [], f"no OpenMP 5.0 `omp_pause_resource_all` in {', '.join(paths)}"
    return found, ""


def release_pool() -> str:
    """Give the calling thread's OpenMP pool back (every loaded runtime's); what was done, or why not.
    Never raises: a runtime without the call leaves the pool as it is."""
    functions, why = _pause_functions()
    if not functions:
        return f"the pool stays: {why}"
    failed = [fn for fn in functions if fn(OMP_PAUSE_SOFT) != 0]  # non-zero: inside a parallel region
    if failed:
        return "the pool stays: the thread is inside a parallel region"
    return "this thread's OpenMP pool released: the engine's thread computes alone"


@contextlib.contextmanager
def pool_released():
    """Compute on a thread other than the engine's: its OpenMP pool given back when it is done."""
    try:
        yield
    finally:
        release_pool()
