"""The router's Prometheus series, and the workers' own series relabelled and merged in.

Every per-worker series carries `worker_id`, `capability` (`9.0` or `cpu`) and `model` labels,
both the router's (requests sent, retries, state, restarts, in flight) and each worker's
`/metrics`, which the router scrapes at request time and relabels, so one scrape of the router
sees every device; families are merged by name across workers, as the text format requires. The
inference gateways' gauges (vLLM names, `workers/contract/defaults.py`) also get the pod's
totals, as the last sample of their family (`worker_id="all"`). Registries are per router, so
several routers in one test process do not collide. Trade-off: a worker that does not answer its
scrape within a second is skipped (counted in `hetserve_router_worker_scrape_errors_total`)
rather than holding up the whole scrape.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from server.fleet.breaker import BreakerState
from server.fleet.canary_record import CanaryCollector
from server.fleet.handle import WorkerHandle
from workers.contract import (
    GATEWAY_KV_USAGE,
    GATEWAY_LORA_INFO,
    GATEWAY_POD,
    GATEWAY_RUNNING,
    GATEWAY_WAITING,
    WorkerState,
)

LORA_INFO = GATEWAY_LORA_INFO

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ("worker_id", "capability", "model")
WORKER_LABELS = _LABELS  # the labels of every per-worker series
_GATEWAY_NAMES = frozenset({GATEWAY_WAITING, GATEWAY_RUNNING, *GATEWAY_KV_USAGE})


def worker_labels(h: WorkerHandle) -> list[str]:
    """The values of `_LABELS` for one worker."""
    return [h.id, h.capability_label, h.model]


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
        breaker = GaugeMetricFamily("hetserve_router_worker_breaker_state",
                                    "1 for the state of the worker's circuit breaker.", labels=[*_LABELS, "state"])
        for h in self._workers_fn():
            labels = worker_labels(h)
            for s in WorkerState:
                state.add_metric([*labels, s], 1.0 if h.state == s else 0.0)
            up.add_metric(labels, 1.0 if h.routable else 0.0)
            restarts.add_metric(labels, float(h.restarts))
            outstanding.add_metric(labels, float(h.outstanding))
            current = h.breaker.state
            for s in BreakerState:
                breaker.add_metric([*labels, s], 1.0 if current == s else 0.0)
        yield from (state, up, restarts, outstanding, breaker)


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
                                     "Streams that ended with an error event: lost by this worker after their "
                                     "first event and continued by none.", _LABELS, registry=self.registry)
        self.stream_migrations = Counter("hetserve_router_worker_stream_migrations",
                                         "Streams this worker lost mid-way that moved to another worker.", _LABELS,
                                         registry=self.registry)
        self.scrape_errors = Counter("hetserve_router_worker_scrape_errors", "Worker /metrics scrapes that failed.",
                                     _LABELS, registry=self.registry)
        self.client_write_timeouts = Counter("hetserve_router_client_write_timeouts",
                                             "Answers cut off because the client read nothing of them for "
                                             "--write-timeout seconds (the request was cancelled).",
                                             registry=self.registry)
        self.registry.register(_WorkerStateCollector(workers_fn))
        self.registry.register(CanaryCollector(workers_fn))
        # each labelled child, found once: `labels()` checks and hashes its values on every call
        self._request_children: dict[tuple[str, int], tuple] = {}
        self._worker_children: dict[tuple[str, ...], object] = {}

    def client_write_timeout(self) -> None:
        self.client_write_timeouts.inc()

    def observe(self, route: str, status: int, seconds: float) -> None:
        children = self._request_children.get((route, status))
        if children is None:  # `route` is one of a bounded set (server/edge/middleware.py `route_label`)
            children = self.requests.labels(route, str(status)), self.latency.labels(route)
            self._request_children[(route, status)] = children
        children[0].inc()
        children[1].observe(seconds)

    def worker_request(self, h: WorkerHandle) -> None:
        labels = (h.id, h.capability_label, h.model)  # as `worker_labels`, which they may change with a restart
        child = self._worker_children.get(labels)
        if child is None:
            child = self._worker_children[labels] = self.worker_requests.labels(*labels)
        child.inc()

    def worker_retry(self, h: WorkerHandle) -> None:
        self.worker_retries.labels(*worker_labels(h)).inc()

    def stream_error(self, h: WorkerHandle) -> None:
        self.stream_errors.labels(*worker_labels(h)).inc()

    def stream_migration(self, h: WorkerHandle) -> None:
        self.stream_migrations.labels(*worker_labels(h)).inc()

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
            self.scrape_errors.labels(*worker_labels(h)).inc()
            return None


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else f"{v:.1f}"


def _kv_weight(h: WorkerHandle) -> float:
    """How much KV cache a worker holds, in tokens (blocks x block size, or slots x length)."""
    capacity = h.info.capacity if h.info is not None else {}
    if capacity.get("kv_blocks_total") and capacity.get("kv_block_size"):
        return float(capacity["kv_blocks_total"] * capacity["kv_block_size"])
    return float(capacity.get("max_tokens") or 1)


def pod_totals(values: dict[str, list[tuple[WorkerHandle, float]]]) -> dict[str, float]:
    """The pod's gateway gauges from its workers': requests add up; KV usage is the fraction of
    all the workers' KV cache in use (each worker's fraction weighted by its cache size)."""
    totals = {name: sum(v for _, v in values[name]) for name in (GATEWAY_WAITING, GATEWAY_RUNNING) if name in values}
    for name in GATEWAY_KV_USAGE:
        if name in values:
            weights = [(_kv_weight(h), v) for h, v in values[name]]
            totals[name] = sum(w * v for w, v in weights) / sum(w for w, _ in weights)
    return totals


def lora_pod(samples: list[tuple[dict, float]]) -> tuple[dict[str, str], float]:
    """The pod's `vllm:lora_requests_info` from its workers': the adapters running (and waiting)
    on any of them, the smallest `max_lora` (what every worker can hold), the latest time."""
    def union(key: str) -> str:
        return ",".join(sorted({n for labels, _ in samples for n in labels.get(key, "").split(",") if n}))

    limits = [int(labels["max_lora"]) for labels, _ in samples if labels.get("max_lora", "").isdigit()]
    return ({"running_lora_adapters": union("running_lora_adapters"),
             "waiting_lora_adapters": union("waiting_lora_adapters"), "max_lora": str(min(limits, default=0))},
            max(value for _, value in samples))


def merge_worker_metrics(scrapes: list[tuple[WorkerHandle, str]]) -> str:
    """Prometheus text of the workers' families, each sample labelled with its worker; the
    gateway gauges end with the pod's total (`worker_id="all"`), which an inference
    gateway's endpoint picker reads for this pod."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    gateway: dict[str, list[tuple[WorkerHandle, float]]] = {}
    lora_samples: list[tuple[dict, float]] = []
    for h, text in scrapes:
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception as e:  # a malformed exposition: skip this worker's series
            logger.warning("worker %s /metrics is not Prometheus text: %r", h.id, e)
            continue
        for fam in parsed:
            entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            for sample in fam.samples:
                labels = {**sample.labels, **dict(zip(_LABELS, worker_labels(h), strict=True))}
                rendered = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                entry[2].append(f"{sample.name}{{{rendered}}} {_format_value(sample.value)}")
                if sample.name in _GATEWAY_NAMES:
                    gateway.setdefault(sample.name, []).append((h, sample.value))
                elif sample.name == LORA_INFO:
                    lora_samples.append((sample.labels, sample.value))
    pod = ",".join(f'{label}="{GATEWAY_POD}"' for label in _LABELS)
    for name, value in pod_totals(gateway).items():
        families[name][2].append(f"{name}{{{pod}}} {_format_value(value)}")
    if lora_samples:
        labels, value = lora_pod(lora_samples)
        rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in {**labels, **dict.fromkeys(_LABELS, GATEWAY_POD)}.items())
        families[LORA_INFO][2].append(f"{LORA_INFO}{{{rendered}}} {_format_value(value)}")
    lines = []
    for name, (kind, doc, samples) in families.items():
        # The parser drops `_total` from counter family names; text format 0.0.4 wants it back.
        header = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {header} {doc.replace(chr(10), ' ')}")
        lines.append(f"# TYPE {header} {'untyped' if kind == 'unknown' else kind}")
        lines.extend(samples)
    return "\n".join(lines) + ("\n" if lines else "")


class ForeignCastCollector:
    """`hetserve_kv_tier_foreign_casts_refused_total` per worker: the blocks of another KV dtype
    whose cast was not exact, so the rest of their prompt was recomputed there (the workers count
    them, workers/kvtier/foreign.py; their `/health` reports the count)."""

    def __init__(self, workers_fn: Callable[[], Iterable[WorkerHandle]]):
        self._workers_fn = workers_fn

    def collect(self):
        refused = CounterMetricFamily("hetserve_kv_tier_foreign_casts_refused", "Blocks of another KV dtype read "
                                      "from the host tier whose cast was not exact: the rest of that prompt was "
                                      "recomputed.", labels=[*WORKER_LABELS, "reason"])
        for h in self._workers_fn():
            capacity = {**(h.info.capacity if h.info is not None else {}), **h.live_capacity}
            foreign = (capacity.get("kv_host_tier") or {}).get("foreign") or {}
            if "casts_refused" in foreign:
                refused.add_metric([*worker_labels(h), "kv_cast_not_exact"], foreign["casts_refused"])
        yield refused
