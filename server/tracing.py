"""The router's spans: one per generation request, with its route decisions and retries.

`TracingMiddleware` (pure ASGI, installed only when tracing is on) opens one SERVER span per
POST request, as a child of the caller's `traceparent` when it sends one, keeps it current
while the route runs and ends it with the last byte of the response (a stream: its last
event). The dispatcher notes on that span each route decision (`route` event: worker,
capability, fp8 convention, the balancer's reason), each failed attempt (`retry` event:
worker, why), each move of a stream to another worker (`migrate` event: the worker that lost
it, why, tokens already sent) and, once a worker answers, that worker's id, capability and
fp8 convention.
Every call to a worker carries the span's context as `traceparent` (`Tracing.inject`), so
the worker's span is its child. With tracing off the middleware is absent and the `note_*`
functions return at their first line.
"""

from __future__ import annotations

from server.worker_handle import WorkerHandle
from workers.contract.tracing import Tracing

TRACED_METHODS = frozenset({"POST"})  # generation; GETs are polls and probes
# Span names carry the route; any other path is `other`, so a scanner cannot multiply names.
GENERATION_ROUTES = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"})


def worker_attributes(worker: WorkerHandle) -> dict[str, str]:
    """The attributes that name a worker on router and worker spans alike."""
    return {
        "hetserve.worker.id": worker.id,
        "hetserve.worker.capability": worker.capability_label,
        "hetserve.fp8.convention": worker.fp8_convention or "unknown",
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


class TracingMiddleware:
    """One SERVER span per POST request, current while the route runs (see module doc)."""

    def __init__(self, app, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in TRACED_METHODS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import Status, StatusCode

        method, path = scope["method"], scope.get("path", "")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        span = self.tracing.start_span(f"{method} {path if path in GENERATION_ROUTES else 'other'}", headers=headers, attributes={
            "http.request.method": method, "url.path": path, "hetserve.retries": 0})
        status = [0]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            with self.tracing.use_span(span):
                await self.app(scope, receive, send_wrapper)
        except BaseException as e:
            span.record_exception(e)
            raise
        finally:
            span.set_attribute("http.response.status_code", status[0])
            if status[0] >= 500 or status[0] == 0:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status[0] or 'no response'}"))
            span.end()
