"""Each worker's cost per phase, fitted over its engine steps: what disaggregated prefill compares.

The router's `SpeedFit` (server/routing/speed.py) fits a step-time model over its two-second
sampling intervals, where the steps, prompt tokens and sequences of one interval rise and fall
together: good enough to spread load, too collinear to tell a card's prefill cost from its decode
cost, which is all that disaggregation asks. So each worker also sums, per step, the moments of a
least-squares fit `y = c + a*P + b*B` (y the step's seconds, P its prompt tokens computed, B its
sequences; workers/engine/metrics.py `step_moments`), and `PhaseFit` solves it from the sums'
growth since the last sample, older intervals decayed (more slowly than the speed fit's: a
device's cost per phase changes little). Every step is a
point: decode-only steps at many batch sizes pin `c` and `b`, steps with prompt chunks pin `a`.
Trade-off: a linear model of one step. Attention's growth with context length and a GPU's flat
step time below its compute bound fold into `b` and `c` as the traffic saw them.
"""

from __future__ import annotations

import numpy as np

from server.fleet.history import read_values
from server.routing.speed import Speed

_SERIES = "hetserve_worker_step_moments_total"
MOMENTS = ("n", "p", "b", "pp", "bb", "pb", "y", "py", "by", "np")
HEADS = frozenset(f'{_SERIES}{{moment="{m}"}}' for m in MOMENTS)
MIN_PREFILL_STEPS = 4  # steps that computed prompt tokens before `a` means anything
MIN_STEPS = 16
# weight kept per sampling interval: a half-life of about 23 intervals (46 s at 2 s). A device's
# cost per phase changes slowly, and a slow worker the router seldom picks sees few steps, which
# a shorter memory would keep forgetting before they add up to a fit.
DECAY = 0.97
_RIDGE = 1e-9  # relative: keeps the normal equations solvable when a column barely varies
_FLOOR_S = 1e-9


def read_moments(text: str) -> dict[str, float] | None:
    """The worker's cumulative step moments in a `/metrics` text (None: it exports none)."""
    v = read_values(text, HEADS)
    if not v:
        return None
    return {m: v.get(f'{_SERIES}{{moment="{m}"}}', 0.0) for m in MOMENTS}


class PhaseFit:
    """Decayed step moments of one worker and the fit they give (`estimate`)."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._sums = dict.fromkeys(MOMENTS, 0.0)
        self._last: dict[str, float] | None = None
        self.samples = 0

    def observe(self, moments: dict[str, float] | None, restarted: bool) -> None:
        """One sample of the cumulative moments; `restarted`: a new process (start afresh from it)."""
        if moments is None:
            return
        last, self._last = self._last, moments
        if last is None or restarted or moments["n"] < last["n"]:
            return
        delta = {m: moments[m] - last[m] for m in MOMENTS}
        if delta["n"] <= 0:
            return
        for m in MOMENTS:
            self._sums[m] = self.decay * self._sums[m] + delta[m]
        self.samples += 1

    def estimate(self) -> Speed | None:
        """The step-time model `Speed(c, a, b)` once `MIN_STEPS` steps, `MIN_PREFILL_STEPS` of them
        with prompt tokens, weigh in it (decayed); None before."""
        s = self._sums
        if s["n"] < MIN_STEPS or s["np"] < MIN_PREFILL_STEPS:
            return None
        xtx = np.array([[s["n"], s["p"], s["b"]], [s["p"], s["pp"], s["pb"]], [s["b"], s["pb"], s["bb"]]])
        xty = np.array([s["y"], s["py"], s["by"]])
        xtx = xtx + np.diag(_RIDGE * np.maximum(np.diag(xtx), 1.0))
        try:
            c, a, b = np.linalg.solve(xtx, xty)
        except np.linalg.LinAlgError:
            return None
        return Speed(step_s=max(_FLOOR_S, float(c)), prefill_s=max(_FLOOR_S, float(a)),
                     sequence_s=max(_FLOOR_S, float(b)), samples=self.samples)
