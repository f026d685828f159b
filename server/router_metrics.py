"""The router's Prometheus series, and the workers' own series relabelled and merged in.

Every per-worker series carries `worker_id` and `capability` labels (`capability` is `9.0`
or `cpu`), both the router's (requests sent, retries, state, restarts, in flight) and each
worker's `/metrics`, which the router scrapes at request time and relabels, so one scrape
of the router sees every device. Families are merged by name across workers, as the text
format requires each family's samples together under one TYPE line. A worker that does not
answer its scrape within a second is skipped and counted in
`hetserve_router_worker_scrape_errors_total`. Registries are per router (not the global
default), so several routers in one test process do not collide.
"""

from __future__ import annotations

import asyncio
import logging
import math

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from server.worker_handle import WorkerHandle
from workers.contract import WorkerState

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ("worker_id", "capability")


class _WorkerStateCollector:
    """Gauges read from the supervisor's handles at scrape time."""

    def __init__(self, workers_fn):
        self._workers_fn = workers_fn

    def collect(self):
        state = GaugeMetricFamily("hetserve_router_worker_state", "1 for the worker's current state.",
                                  labels=[*_LABELS, "state"])
        up = GaugeMetricFamily("hetserve_router_worker_up", "1 when the worker is ready.", labels=_LABELS)
        restarts = GaugeMetricFamily("hetserve_router_worker_restarts", "Restarts after crashes.", labels=_LABELS)
        outstanding = GaugeMetricFamily("hetserve_router_worker_outstanding_requests",
                                        "Requests in flight at the worker.", labels=_LABELS)
        for h in self._workers_fn():
            labels = [h.id, h.capability_label]
            for s in WorkerState:
                state.add_metric([*labels, s], 1.0 if h.state == s else 0.0)
            up.add_metric(labels, 1.0 if h.routable else 0.0)
            restarts.add_metric(labels, float(h.restarts))
            outstanding.add_metric(labels, float(h.outstanding))
        yield from (state, up, restarts, outstanding)


class RouterMetrics:
    def __init__(self, workers_fn=lambda: ()):
        self._workers_fn = workers_fn
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("hetserve_router_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("hetserve_router_request_duration_seconds",
                                 "Time to the complete response (streams: to the last event).",
                                 ["route"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf))
        self.worker_requests = Counter("hetserve_router_worker_requests", "Requests sent to the worker.",
                                       _LABELS, registry=self.registry)
        self.worker_retries = Counter("hetserve_router_worker_retries",
                                      "Requests the worker failed before answering, retried elsewhere.",
                                      _LABELS, registry=self.registry)
        self.stream_errors = Counter("hetserve_router_worker_stream_errors",
                                     "Streams the worker lost after their first event.", _LABELS,
                                     registry=self.registry)
        self.scrape_errors = Counter("hetserve_router_worker_scrape_errors", "Worker /metrics scrapes that failed.",
                                     _LABELS, registry=self.registry)
        self.registry.register(_WorkerStateCollector(workers_fn))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def worker_request(self, h: WorkerHandle) -> None:
        self.worker_requests.labels(h.id, h.capability_label).inc()

    def worker_retry(self, h: WorkerHandle) -> None:
        self.worker_retries.labels(h.id, h.capability_label).inc()

    def stream_error(self, h: WorkerHandle) -> None:
        self.stream_errors.labels(h.id, h.capability_label).inc()

    async def render(self) -> str:
        """Router series, then every ready worker's series relabelled and merged by family."""
        workers = [h for h in self._workers_fn() if h.routable]
        texts = await asyncio.gather(*(self._scrape(h) for h in workers))
        merged = merge_worker_metrics([(h, t) for h, t in zip(workers, texts, strict=True) if t is not None])
        return generate_latest(self.registry).decode() + merged

    async def _scrape(self, h: WorkerHandle) -> str | None:
        try:
            assert h.client is not None
            return await asyncio.wait_for(h.client.metrics(), 1.0)
        except Exception as e:  # any failure: skip this worker in this scrape
            logger.debug("scrape of worker %s failed: %r", h.id, e)
            self.scrape_errors.labels(h.id, h.capability_label).inc()
            return None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{v:.1f}"


def merge_worker_metrics(scrapes: list[tuple[WorkerHandle, str]]) -> str:
    """Prometheus text of the workers' families, each sample labelled with its worker."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for h, text in scrapes:
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception as e:  # a malformed exposition: skip this worker's series
            logger.warning("worker %s /metrics is not Prometheus text: %r", h.id, e)
            continue
        for fam in parsed:
            entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for sample in fam.samples:
                labels = {**sample.labels, "worker_id": h.id, "capability": h.capability_label}
                rendered = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                entry[2].append(f"{sample.name}{{{rendered}}} {_format_value(sample.value)}")
    lines = []
    for name, (kind, doc, samples) in families.items():
        # The parser drops `_total` from counter family names; text format 0.0.4 wants it back.
        header = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {header} {doc.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {header} {'untyped' if kind == 'unknown' else kind}")
        lines.extend(samples)
    return "\n".join(lines) + ("\n" if lines else "")
