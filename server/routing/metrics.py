"""The routing series in the router's `/metrics`, read from the `Router` at scrape time.

Each series of a worker carries `worker_id`, `capability` and `model`:
- `hetserve_router_route_decisions_total{..., reason}`: requests sent, by why
  (`prefix`, `session`, `least-loaded`, `pinned`, `imbalance`, `round-robin`; a retry is a decision too);
- `hetserve_router_session_moves_total{..., why}`: sessions that left this
  worker (`unavailable`, `overloaded`);
- `hetserve_router_worker_prefill_tokens_per_second`, `..._decode_tokens_per_second{batch}`:
  the measured speeds, decode for one sequence and for a batch of 8 (absent until measured);
- `hetserve_router_worker_inflight_tokens{kind="to_prefill"|"new"|"total"}`: the load the router counts there;
- `hetserve_router_prefix_index_chunks`: prompt chunks the index remembers for that worker;
- `hetserve_router_chars_per_token`, `hetserve_router_sessions`: fleet-wide.

Design: a collector over the router's plain counters, so routing keeps no Prometheus objects
and a scrape costs one pass over the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.fleet.handle import WorkerHandle
from server.routing.router import Router
from server.routing.speed import REFERENCE_BATCH

_LABELS = ("worker_id", "capability", "model")


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
            if speed is not None:
                prefill.add_metric(labels, speed.prefill_tps)
                for batch in (1, REFERENCE_BATCH):
                    decode.add_metric([*labels, str(batch)], speed.decode_tps(batch))
            for kind, value in zip(("to_prefill", "new", "total"), r.inflight(h.id), strict=True):
                inflight.add_metric([*labels, kind], value)
            chunks.add_metric(labels, r.index.size(h.id))
        yield from (decisions, moves, prefill, decode, inflight, chunks)
        yield GaugeMetricFamily("hetserve_router_chars_per_token", "Characters per token, as learned from the "
                                "workers' prompt token counts.", value=r.telemetry.chars_per_token)
        yield GaugeMetricFamily("hetserve_router_sessions", "Sessions whose worker the router remembers.",
                                value=len(r.sessions))
