"""Bounded native memory on CPU: few distinct matmul shapes, capped kernel caches.

On CPU, a bfloat16/float16 `nn.Linear` runs through oneDNN, which compiles one matmul
kernel per distinct row count and keeps it in two caches (oneDNN's primitive cache and
torch's ideep cache, 1024 entries each by default), about 0.5-1.5 MiB per entry on AMX
CPUs. An engine step multiplies as many rows as it has tokens, and that number varies
with every mix of prefills and decodes (dropped streams leave odd batch sizes behind), so
a long-running worker kept compiling new shapes and its memory grew by hundreds of MiB.

Two bounds, applied to a CPU worker (its projections run through oneDNN in float32 too, with
packed weights: workers/model/cpu_projections.py):
1. `row_bucket(rows)` is the padded row count of every projection (exact up to 16, then two
   sizes per octave: 24, 32, 48, 64, 96, ...), so the shapes a worker ever compiles are a few
   dozen; the padding costs at most a third more rows, and only on steps larger than 16 tokens.
2. `cap_native_caches()` (before torch is imported) sets both caches to `NATIVE_CACHE_ENTRIES`
   unless the environment already says otherwise, enough for every bucket of a model's
   few projection shapes.
Trade-off: a step of 17 tokens multiplies 24 rows; in exchange a worker's memory stops
growing once the buckets it uses are compiled. GPUs need neither (no per-shape cache).
"""

from __future__ import annotations

import os

# torch is imported inside the functions: `cap_native_caches` must run before torch loads.

EXACT_ROWS = 16
NATIVE_CACHE_ENTRIES = 256
_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def cap_native_caches(entries: int = NATIVE_CACHE_ENTRIES) -> None:
    """Cap oneDNN's and ideep's kernel caches (read once, at their first use)."""
    for name in _CACHE_ENV:
        os.environ.setdefault(name, str(entries))


def row_bucket(rows: int) -> int:
    """The padded row count: `rows` up to 16, else the next of 24, 32, 48, 64, 96, 128, ..."""
    if rows <= EXACT_ROWS:
        return rows
    power = 1 << (rows - 1).bit_length()  # the next power of two >= rows
    three_quarters = power // 4 * 3
    return three_quarters if rows <= three_quarters else power
