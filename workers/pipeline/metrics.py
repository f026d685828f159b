"""Each pipeline stage's own step figures, in the first stage's `/metrics`.

Design: a stage after the first serves no HTTP, so it reports through its status file (the
file the router already reads for every worker): every half second of steps it rewrites its
step count, the seconds its layers took (not the time spent waiting for the previous stage)
and when its last step ended. The first stage's runner counts its own layers' time likewise,
and `StageMetrics`, registered beside the engine's series, reads all of them when scraped:
`hetserve_worker_pipeline_stage_steps_total`, `..._stage_compute_seconds_total` and
`..._stage_last_step_age_seconds`, labelled by stage. The engine's own step histogram and
liveness remain the whole pipeline's (a step ends when the last stage's logits are back), so
a hung stage shows there, and here as the stage whose last step grows old. The trade-off: a
follower's figures are at most half a second old.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers.engine.metrics import PREFIX

REPORT_S = 0.5


class StageClock:
    """A stage's own steps and compute seconds; `report` is called at most every `REPORT_S`."""

    def __init__(self, report: Callable[[int, float, float], None] | None = None):
        self.steps, self.seconds, self.last = 0, 0.0, None
        self._report, self._reported = report, 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.last = time.time()
        if self._report is not None and self.last - self._reported >= REPORT_S:
            self._reported = self.last
            self._report(self.steps, self.seconds, self.last)

    def flush(self) -> None:
        if self._report is not None and self.last is not None:
            self._report(self.steps, self.seconds, self.last)


class StageMetrics:
    """The collector: stage 0 from its runner's clock, the others from their status files."""

    def __init__(self, own: StageClock, status_files: list[str | None]):
        self.own, self.files = own, status_files

    def _figures(self) -> list[tuple[int, float, float | None]]:
        rows = [(self.own.steps, self.own.seconds, self.own.last)]
        for path in self.files:
            try:
                with open(path) as f:
                    s = json.load(f)
            except (OSError, TypeError, ValueError):
                s = {}
            rows.append((int(s.get("steps", 0)), float(s.get("step_seconds", 0.0)), s.get("last_step")))
        return rows

    def collect(self):
        steps = CounterMetricFamily(f"{PREFIX}_pipeline_stage_steps", "Steps each pipeline stage computed",
                                    labels=["stage"])
        seconds = CounterMetricFamily(f"{PREFIX}_pipeline_stage_compute_seconds",
                                      "Seconds each pipeline stage spent computing its layers", labels=["stage"])
        age = GaugeMetricFamily(f"{PREFIX}_pipeline_stage_last_step_age_seconds",
                                "Seconds since each pipeline stage's last step ended", labels=["stage"])
        now = time.time()
        for rank, (n, s, last) in enumerate(self._figures()):
            steps.add_metric([str(rank)], n)
            seconds.add_metric([str(rank)], s)
            if last is not None:
                age.add_metric([str(rank)], max(0.0, now - float(last)))
        yield from (steps, seconds, age)
