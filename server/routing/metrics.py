"""The routing series in the router's `/metrics`, read from the `Router` at scrape time.

Each series of a worker carries `worker_id`, `capability` and `model`; the list is in
docs/routing.md. Design: a collector over the router's plain counters, so routing keeps no
Prometheus objects and a scrape costs one pass over the workers. The trade-off: a speed is shown
only once measured (a cost the fit still holds at its floor is left out, `speed_view`), so a new
worker has no speed series rather than an absurd one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.fleet.handle import WorkerHandle
from server.routing.router import Router, speed_entry
from server.routing.speed import REFERENCE_BATCH, Speed

_LABELS = ("worker_id", "capability", "model")
# The speed fit keeps every cost at or above its floor (1e-9 s, server/routing/speed.py): a cost
# still that small was never measured apart, and its inverse (1e9 tokens/s) is no measured speed.
UNMEASURED_S = 1e-8


def prefill_tps(speed: Speed) -> float | None:
    """Prompt tokens per engine-second, None while the per-token cost is unmeasured."""
    return None if speed.prefill_s <= UNMEASURED_S else speed.prefill_tps


def decode_tps(speed: Speed, batch: float) -> float | None:
    """Generated tokens per engine-second in a batch of `batch`, None while the step is unmeasured."""
    return None if speed.step_time(batch) <= UNMEASURED_S * (1 + batch) else speed.decode_tps(batch)


def speed_view(speed: Speed | None) -> dict | None:
    """`/workers` `routing.speed` with every figure the fit has not measured as None (not 1e9)."""
    if speed is None:
        return None
    entry = speed_entry(speed)
    if prefill_tps(speed) is None:
        entry["prefill_tokens_per_s"] = None
    for key, batch in (("decode_tokens_per_s", 1), (f"decode_tokens_per_s_batch_{REFERENCE_BATCH}", REFERENCE_BATCH)):
        if decode_tps(speed, batch) is None:
            entry[key] = None
    for key, value_s in (("step_ms", speed.step_s), ("per_sequence_ms", speed.sequence_s)):
        if value_s <= UNMEASURED_S:
            entry[key] = None
    return entry


class RoutingCollector:
    def __init__(self, router: Router, workers_fn: Callable[[], Iterable[WorkerHandle]]):
        self._router = router
        self._workers_fn = workers_fn

    def collect(self):
        r = self._router
        decisions = CounterMetricFamily("hetserve_router_route_decisions", "Requests sent to the worker, by the "
                                        "routing decision's reason.", labels=[*_LABELS, "reason"])
        moves = CounterMetricFamily("hetserve_router_session_moves", "Sessions that left this worker for another, "
                                    "by why.", labels=[*_LABELS, "why"])
        prefill = GaugeMetricFamily("hetserve_router_worker_prefill_tokens_per_second",
                                    "Measured prompt tokens per engine-second.", labels=_LABELS)
        decode = GaugeMetricFamily("hetserve_router_worker_decode_tokens_per_second",
                                   "Measured generated tokens per engine-second, for a batch of this size.",
                                   labels=[*_LABELS, "batch"])
        inflight = GaugeMetricFamily("hetserve_router_worker_inflight_tokens", "Tokens the router has in flight "
                                     "there (to_prefill: prompt tokens not held in its cache; new: max_new_tokens; "
                                     "total: whole prompts and their max_new_tokens).", labels=[*_LABELS, "kind"])
        chunks = GaugeMetricFamily("hetserve_router_prefix_index_chunks", "Prompt prefix chunks the router "
                                   "remembers for the worker.", labels=_LABELS)
        for h in self._workers_fn():
            labels = [h.id, h.capability_label, h.model]
            for (wid, reason), n in r.decisions.items():
                if wid == h.id:
                    decisions.add_metric([*labels, reason], n)
            for (wid, why), n in r.sessions.moves.items():
                if wid == h.id:
                    moves.add_metric([*labels, why], n)
            speed = r.telemetry.speed(h.id)
            if speed is not None:  # only what was measured: no sample rather than 1e9 tokens/s
                if prefill_tps(speed) is not None:
                    prefill.add_metric(labels, prefill_tps(speed))
                for batch in (1, REFERENCE_BATCH):
                    if decode_tps(speed, batch) is not None:
                        decode.add_metric([*labels, str(batch)], decode_tps(speed, batch))
            for kind, value in zip(("to_prefill", "new", "total"), r.inflight(h.id), strict=True):
                inflight.add_metric([*labels, kind], value)
            chunks.add_metric(labels, r.index.size(h.id))
        yield from (decisions, moves, prefill, decode, inflight, chunks)
        yield GaugeMetricFamily("hetserve_router_chars_per_token", "Characters per token, as learned from the "
                                "workers' prompt token counts.", value=r.telemetry.chars_per_token)
        yield GaugeMetricFamily("hetserve_router_sessions", "Sessions whose worker the router remembers.",
                                value=len(r.sessions))
