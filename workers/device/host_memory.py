"""The host's allocator: a step's large temporaries kept for the next step, not handed back each time.

Why: glibc's malloc serves an allocation above its mmap threshold (128 KiB at first, raised as
such chunks are freed, up to 32 MiB) with fresh pages from `mmap`, and gives a heap's top back
once more than its trim threshold lies free there. An engine step allocates its activations anew
and frees them at its end, so steps kept faulting in and zeroing fresh pages (docs/benchmarks.md,
"Prefill step"). Design: `keep_freed_memory()`, first thing in a worker process, sets the mmap
threshold to its largest value (`MMAP_THRESHOLD`, which also stops it moving) and the trim
threshold to `TRIM_BYTES` through `mallopt`, and returns what it did and why (nothing, and says
so, on a C library without `mallopt`). Trade-off: the worker's resident memory stays at the
high-water mark of its steps' temporaries (bounded by the step's token budget) instead of falling
back after each step; an allocation above `MMAP_THRESHOLD` still maps fresh pages."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit hosts (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 512 << 20


def keep_freed_memory() -> str:
    """Keep a step's freed temporaries in the process (see the module docstring); what was done."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return "this C library has no mallopt: its allocator's defaults"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        return "mallopt refused the thresholds: glibc's defaults"
    return (f"glibc malloc: allocations up to {MMAP_THRESHOLD >> 20} MiB from the heap, up to {TRIM_BYTES >> 20} MiB "
            "freed kept for the next step (no fresh pages per step)")
