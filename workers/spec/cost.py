"""The worker's own step costs, measured from its steps: what a plain decode step of B rows and a
speculative step of N query tokens take on this device, under its current load.

Design: every engine step without a prompt chunk is timed (proposal to delivery: the drafts, the
forward, sampling and verification alike) and kept per path and size: `plain` by its decode rows,
`spec` by its query tokens (each row's last token plus its drafts), the median of the size's last
`WINDOW` steps (a step stalled by a neighbour on a shared machine does not move it). A size never
measured is estimated from the least-squares line through the measured sizes of its path; no line
(fewer than two sizes) is no estimate, and the policy measures first, and trusts the line only up
to twice the largest size measured. A memory-bound GPU shows a flat `spec` line (k more
query tokens for nearly the price of one), a compute-bound CPU a steep one, and both lines rise
with the load the device shares. Trade-off: learned from the traffic instead of a calibration at
start (no start-up cost, no synthetic sequences in the KV cache), so the first steps of a fresh
worker explore; the line ignores context length and graph buckets (one slope per path).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 8  # steps per size whose median is its cost


@dataclass(frozen=True)
class Estimate:
    seconds: float
    measured: bool  # this very size was measured (else: the path's line)


class StepCosts:
    """Step seconds per (path, size): the median of the last `WINDOW`; engine thread only."""

    def __init__(self) -> None:
        self._mean: dict[str, dict[int, float]] = {"plain": {}, "spec": {}}
        self._count: dict[str, dict[int, int]] = {"plain": {}, "spec": {}}
        self._last: dict[tuple[str, int], deque[float]] = {}

    def record(self, path: str, size: int, seconds: float) -> None:
        last = self._last.setdefault((path, size), deque(maxlen=WINDOW))
        last.append(seconds)
        self._mean[path][size] = statistics.median(last)
        self._count[path][size] = self._count[path].get(size, 0) + 1

    def largest(self, path: str) -> int:
        """The largest size measured on `path` (0: none)."""
        return max(self._mean[path], default=0)

    def samples(self, path: str, size: int | None = None) -> int:
        """Steps recorded at `size` (None: at every size of the path)."""
        count = self._count[path]
        return sum(count.values()) if size is None else count.get(size, 0)

    def sizes(self, path: str) -> int:
        return len(self._mean[path])

    def estimate(self, path: str, size: int) -> Estimate | None:
        """Seconds of a `path` step of `size`: its median, else the path's line; None: no line yet."""
        mean = self._mean[path]
        if size in mean:
            return Estimate(mean[size], True)
        if len(mean) < 2:
            return None
        xs, ys = list(mean), list(mean.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
        return Estimate(max(my + slope * (size - mx), min(ys)), False)

    def describe(self) -> dict:
        """Milliseconds per measured size, per path (for `/capability`)."""
        return {path: {str(size): round(s * 1e3, 2) for size, s in sorted(mean.items())}
                for path, mean in self._mean.items()}
