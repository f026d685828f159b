"""Bounded native memory on CPU: few distinct matmul shapes, capped kernel caches.

On a CPU oneDNN compiles one matmul kernel per distinct row count and keeps it in two caches
(its primitive cache and torch's ideep cache), and an engine step's row count varies with every
mix of prefills and decodes, so a long-running worker kept compiling shapes and its memory grew.
Design, two bounds on a CPU worker: `row_bucket(rows)` pads every projection's rows (exact up to
`EXACT_ROWS`, then two sizes per octave: 24, 32, 48, 64, 96, ...), so a worker compiles a few
dozen shapes; `cap_native_caches()`, before torch is imported, sets both caches to
`NATIVE_CACHE_ENTRIES` unless the environment says otherwise. Trade-off: up to a third more rows
on steps larger than `EXACT_ROWS` tokens (17 tokens multiply 24 rows), for a memory that stops
growing once the used buckets are compiled. GPUs need neither (no per-shape cache)."""

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
