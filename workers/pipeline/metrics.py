"""Each pipeline stage's own step figures, in the first stage's `/metrics` and the host's stage timings.

Design: a stage after the first serves no HTTP, so it reports through its status file, which the
router reads for every worker: every half second of steps it rewrites its step count, its layers'
seconds, its thread's busy seconds in all and when its last step ended. The first stage's runner
counts its own layers likewise, and `StageMetrics` reads them all when scraped
(`hetserve_worker_pipeline_stage_*`, labelled by stage); the engine's own step histogram and
liveness remain the whole pipeline's, so a hung stage shows there and here as the stage whose last
step grows old. The same figures go every `RECORD_S` and at the end to the host's stage timings
(workers/contract/stage_timing.py), from which the router's next split takes each device's
measured speed. Trade-off: a follower's figures are at most half a second old."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers.contract.stage_timing import RECORD_S, PipelineTiming, StageTiming, record_timing, timings_path
from workers.engine.metrics import PREFIX

logger = logging.getLogger(__name__)

REPORT_S = 0.5
IDLE_S = 1.0  # a gap this long between two steps, not spent waiting, is idle time, not work


class StageClock:
    """A stage's own steps, the wall seconds of its layers, and the wall seconds its thread was busy
    (from one step's end to the next's, less the time it waited: for the previous stage's data,
    for a send to leave, for work to arrive); `report(clock)` is called at most every `REPORT_S`."""

    def __init__(self, report: Callable[[StageClock], None] | None = None, host_cpu: bool = True):
        self.steps, self.seconds, self.busy, self.last = 0, 0.0, 0.0, None
        self.host_cpu = host_cpu  # its layers compute on the host's CPU
        self._report, self._reported = report, 0.0
        # when the last step's layers ended, on which thread, and what each thread waited since:
        # an idle engine runs a new request's first step on the HTTP thread while its own thread
        # waits for work, so the time between two steps counts only when one thread ran both
        self._ended, self._thread = 0.0, None
        self._waited: dict[int, float] = {}

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Count the enclosed layers' step, and the busy time since the last step ended."""
        me = threading.get_ident()
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        between = t0 - self._ended - self._waited.get(me, 0.0) if self._thread == me else 0.0
        busy = t1 - t0 + (between if 0.0 < between < IDLE_S else 0.0)  # longer: an idle gap, not work
        self._ended, self._thread, self._waited[me] = t1, me, 0.0
        self.add(t1 - t0, busy)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the enclosed wait of this thread (not busy)."""
        me = threading.get_ident()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waited[me] = self._waited.get(me, 0.0) + time.perf_counter() - t0

    def add(self, seconds: float, busy: float | None = None) -> None:
        """One step: its layers' wall seconds and the busy seconds since the last (None: its layers')."""
        self.steps += 1
        self.seconds += seconds
        self.busy += seconds if busy is None else busy
        self.last = time.time()
        if self._report is not None and self.last - self._reported >= REPORT_S:
            self._reported = self.last
            self._report(self)

    def figures(self) -> dict:
        """What a stage's status file carries (read back by `StageMetrics` and `TimingRecorder`)."""
        return {"steps": self.steps, "step_seconds": self.seconds, "last_step": self.last,
                "busy_seconds": self.busy, "host_cpu": self.host_cpu}

    def flush(self) -> None:
        if self._report is not None and self.last is not None:
            self._report(self)


def read_figures(own: StageClock, status_files: Sequence[str | None]) -> list[dict]:
    """Every stage's figures, in stage order: this stage's clock, then each later stage's status file."""
    rows = [own.figures()]
    for path in status_files:
        try:
            with open(path) as f:
                rows.append(json.load(f))
        except (OSError, TypeError, ValueError):
            rows.append({})
    return rows


class TimingRecorder:
    """Writes a pipeline's figures to the host's stage timings at most every `RECORD_S`, and when it
    stops (`record(force=True)`); never raises into the engine (a failed write is logged once)."""

    def __init__(self, plan, own: StageClock, status_files: Sequence[str | None], path=None):
        self.plan, self.own, self.files = plan, own, list(status_files)
        self.path = timings_path() if path is None else path
        self._written, self._warned = 0.0, False

    def record(self, force: bool = False) -> bool:
        """Record now if due (or `force`d) and the figures are usable; whether a record was written."""
        now = time.time()
        if not self.plan.timing_model or (not force and now - self._written < RECORD_S):
            return False
        stages = []
        for stage, fig in zip(self.plan.stages, read_figures(self.own, self.files), strict=True):
            stages.append(StageTiming(stage.timing_device, stage.end - stage.start, int(fig.get("steps", 0)),
                                      float(fig.get("step_seconds", 0.0)), float(fig.get("busy_seconds", 0.0)),
                                      bool(fig.get("host_cpu", True))))
        timing = PipelineTiming(self.plan.timing_model, tuple(stages), now)
        if not timing.usable() or not all(s.device for s in stages):
            return False
        self._written = now
        try:
            record_timing(self.path, timing)
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("stage timings not recorded in %s: %s", self.path, e)
            return False
        return True


class StageMetrics:
    """The collector: stage 0 from its runner's clock, the others from their status files."""

    def __init__(self, own: StageClock, status_files: list[str | None]):
        self.own, self.files = own, status_files

    def _figures(self) -> list[tuple[int, float, float | None]]:
        return [(int(f.get("steps", 0)), float(f.get("step_seconds", 0.0)), f.get("last_step"))
                for f in read_figures(self.own, self.files)]

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
