"""Recent history per worker for the status page: tokens/s, KV cache usage, load.

`/workers` says what each worker is; the page also wants how busy it has been over the last
minutes. A `WorkerStats` task samples every ready worker's `/metrics` every
`interval_s` (2 s) and keeps, per worker, a fixed window of tokens/s (the change of
`hetserve_worker_generated_tokens_total` between samples), plus the latest KV usage and
running/waiting counts (the gateway gauges). A worker that is not ready, or does not
answer within a second, gets a gap (`None`) in its series; a restarted worker (new pid)
starts its counter again. Trade-off: one small scrape per worker every two seconds whether
or not anyone watches, so the history exists when the page opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from server.fleet.handle import WorkerHandle
from workers.contract import GATEWAY_KV_USAGE, GATEWAY_RUNNING, GATEWAY_WAITING

logger = logging.getLogger(__name__)

GENERATED = "hetserve_worker_generated_tokens_total"
KV_USAGE, RUNNING, WAITING = GATEWAY_KV_USAGE[0], GATEWAY_RUNNING, GATEWAY_WAITING
_WANTED = (GENERATED, KV_USAGE, RUNNING, WAITING)
_SCRAPE_TIMEOUT_S = 1.0


def read_values(text: str, names: Iterable[str] = _WANTED) -> dict[str, float]:
    """The first sample of each wanted series in Prometheus text (a line scan, no full parse): a
    bare name matches its first series, a name with labels (`name{k="v"}`, as rendered) that
    series only."""
    wanted, found = set(names), {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        if "{" in line:
            end = line.rindex("}") + 1
            head, value = line[:end], line[end:].split()
        else:
            head, *value = line.split()
        key = head if head in wanted else head.partition("{")[0]
        if key in wanted and key not in found and value:
            with contextlib.suppress(ValueError):
                found[key] = float(value[0])
    return found


@dataclass
class _Series:
    """One worker's window of samples."""

    points: deque  # tokens/s per interval, None where the worker could not be read
    pid: int | None = None
    last_total: float | None = None
    last_time: float | None = None
    latest: dict[str, float] = field(default_factory=dict)
    sampled_at: float | None = None  # wall clock of the last good sample


class WorkerStats:
    """Samples the workers' series (see the module docstring); `snapshot()` is the JSON."""

    def __init__(self, workers_fn: Callable[[], Iterable[WorkerHandle]], interval_s: float = 2.0,
                 window_s: float = 300.0, observers: Iterable[Callable[[WorkerHandle, str | None], None]] = ()):
        self._workers_fn = workers_fn
        self._observers = tuple(observers)  # also handed each sample (the router's speed estimates)
        self.interval_s = interval_s
        self.window = max(2, int(window_s / interval_s))
        self.window_s = self.window * interval_s
        self._series: dict[str, _Series] = {}

    def _series_of(self, worker_id: str) -> _Series:
        if worker_id not in self._series:
            self._series[worker_id] = _Series(deque(maxlen=self.window))
        return self._series[worker_id]

    async def run(self) -> None:
        """Sample forever (cancel to stop)."""
        while True:
            started = time.monotonic()
            with contextlib.suppress(Exception):  # a sampling error never stops the page's history
                await self.sample_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def sample_once(self) -> None:
        workers = list(self._workers_fn())
        texts = await asyncio.gather(*(self._scrape(h) for h in workers))
        now = time.monotonic()
        for h, text in zip(workers, texts, strict=True):
            self._record(self._series_of(h.id), h.pid, text, now)
            for observe in self._observers:
                observe(h, text)

    @staticmethod
    async def _scrape(h: WorkerHandle) -> str | None:
        if not h.routable or h.client is None:
            return None
        try:
            return await asyncio.wait_for(h.client.metrics(), _SCRAPE_TIMEOUT_S)
        except Exception as e:  # not answering now: a gap in the series
            logger.debug("stats scrape of worker %s failed: %r", h.id, e)
            return None

    @staticmethod
    def _record(s: _Series, pid: int | None, text: str | None, now: float) -> None:
        values = read_values(text) if text is not None else {}
        total = values.get(GENERATED)
        if total is None:
            s.points.append(None)
            s.latest = {}
            return
        if pid != s.pid or s.last_total is None or total < s.last_total:  # first sample of this process
            s.points.append(None)
        else:
            s.points.append(round((total - s.last_total) / max(1e-6, now - s.last_time), 2))
        s.pid, s.last_total, s.last_time = pid, total, now
        s.latest, s.sampled_at = values, time.time()

    def snapshot(self) -> dict:
        """Per worker id: `tokens_per_s` (oldest first), `kv_usage`, `running`, `waiting`, `generated_tokens`."""
        out = {}
        for h in self._workers_fn():
            s = self._series_of(h.id)
            latest = s.latest
            out[h.id] = {
                "tokens_per_s": list(s.points),
                "kv_usage": latest.get(KV_USAGE),
                "running": _int_or_none(latest.get(RUNNING)),
                "waiting": _int_or_none(latest.get(WAITING)),
                "generated_tokens": _int_or_none(latest.get(GENERATED)),
                "sampled_at": s.sampled_at,
            }
        return out


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)
