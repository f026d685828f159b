"""Engine liveness: is work pending, and how long since the engine last completed a step?

A worker whose engine hangs (a stuck kernel, a deadlocked thread) may still answer HTTP from
its event loop, so "the socket answers" is not proof of progress. The engine stamps the end
of every step; `/health` reports whether requests are pending and the age of the last step,
counted from when work arrived if the engine was idle before (an idle engine has no steps to
show and is not stalled). The router takes a worker with pending work and no step for longer
than its stall timeout out of rotation. Trade-off: a single step longer than that timeout (a
huge prefill on a slow device) reads as a stall; the default timeout is far above any step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Liveness:
    pending: bool  # requests accepted and not finished
    last_step_age_s: float  # seconds since the last completed step (or since work arrived, if later)
    steps: int  # steps completed since the engine started


class LivenessClock:
    """Stamped by the engine (`work_arrived`, `step_done`); read from any thread (`read`)."""

    def __init__(self) -> None:
        self._last_step = time.monotonic()
        self._work_since = 0.0
        self.steps = 0
        self.held = False  # the steps wait on purpose (a compile behind the serving holds them)

    def work_arrived(self) -> None:
        """Call when an idle engine gets its first request."""
        self._work_since = time.monotonic()

    def step_done(self) -> None:
        self._last_step = time.monotonic()
        self.steps += 1

    def progress(self) -> None:
        """Work beside the steps (an embedding's forward) completed: the engine is not stalled."""
        self._last_step = time.monotonic()

    def resumed(self) -> None:
        """The steps waited on purpose until now: the age counts from here."""
        self.held, self._last_step = False, time.monotonic()

    def read(self, pending: bool) -> Liveness:
        age = time.monotonic() - max(self._last_step, self._work_since) if pending and not self.held else 0.0
        return Liveness(pending, max(0.0, age), self.steps)
