"""What the dispatcher notes on a request's span: its route decisions, retries and migrations.

The edge opens one span per generation request (server/edge/tracing.py); the dispatcher notes
each route decision (`route` event: worker, capability, fp8 convention, the routing reason),
each failed attempt (`retry`: worker, why), each move of a stream (`migrate`: the worker that
lost it, why, tokens already sent) and, once a worker answers, that worker's id, capability and
fp8 convention. Every call to a worker carries the span's context as `traceparent`
(`Tracing.inject`), so the worker's span is its child. Trade-off: with tracing off the `note_*`
functions return at their first line, so spans cost nothing unless asked for.
"""

from __future__ import annotations

from server.fleet.handle import WorkerHandle
from workers.contract.tracing import Tracing


def worker_attributes(worker: WorkerHandle) -> dict[str, str]:
    """The attributes that name a worker on router and worker spans alike."""
    return {
        "hetserve.worker.id": worker.id,
        "hetserve.worker.capability": worker.capability_label,
        "hetserve.fp8.convention": worker.fp8_label or "unknown",  # as X-Fp8-Convention: "not used (...)" unless used
    }


def note_route(tracing: Tracing, worker: WorkerHandle, reason: str, attempt: int) -> None:
    """A route decision, as an event on the request's span."""
    if tracing.enabled:
        tracing.current_span().add_event("route", {**worker_attributes(worker), "hetserve.route.reason": reason,
                                                   "hetserve.attempt": attempt})


def note_retry(tracing: Tracing, worker: WorkerHandle, why: str) -> None:
    """An attempt that failed before the client got anything; the request goes elsewhere."""
    if tracing.enabled:
        span = tracing.current_span()
        span.add_event("retry", {**worker_attributes(worker), "hetserve.retry.reason": why})
        retries = getattr(span, "attributes", None) or {}
        span.set_attribute("hetserve.retries", int(retries.get("hetserve.retries", 0)) + 1)


def note_migration(tracing: Tracing, worker: WorkerHandle, why: str, tokens_sent: int) -> None:
    """A stream under way lost `worker` and moves to another one from token `tokens_sent`."""
    if tracing.enabled:
        span = tracing.current_span()
        span.add_event("migrate", {**worker_attributes(worker), "hetserve.migration.reason": why,
                                   "hetserve.migration.tokens_sent": tokens_sent})
        moves = getattr(span, "attributes", None) or {}
        span.set_attribute("hetserve.migrations", int(moves.get("hetserve.migrations", 0)) + 1)


def note_answer(tracing: Tracing, worker: WorkerHandle) -> None:
    """The worker that answered (the last one, when a request has several choices)."""
    if tracing.enabled:
        tracing.current_span().set_attributes(worker_attributes(worker))


