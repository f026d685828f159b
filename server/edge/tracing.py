"""The router's span per generation request, opened at the edge.

`TracingMiddleware` (pure ASGI, installed only when tracing is on) opens one SERVER span per
POST request, as a child of the caller's `traceparent` when it sends one, keeps it current
while the route runs and ends it with the last byte of the response (a stream: its last
event), with the status code; a 5xx or no response at all marks it an error. The dispatcher
adds its events to that span (server/dispatch/spans.py). Span names carry the route, so
dashboards group by it.
"""

from __future__ import annotations

from workers.contract.tracing import Tracing

TRACED_METHODS = frozenset({"POST"})  # generation; GETs are polls and probes
# Span names carry the route; any other path is `other`, so a scanner cannot multiply names.
GENERATION_ROUTES = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"})


class TracingMiddleware:
    """One SERVER span per POST request, current while the route runs (see module doc)."""

    def __init__(self, app, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in TRACED_METHODS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import Status, StatusCode  # deferred: imported only when tracing is on

        method, path = scope["method"], scope.get("path", "")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())
                   if k in (b"traceparent", b"tracestate")}
        name = f"{method} {path if path in GENERATION_ROUTES else 'other'}"
        span = self.tracing.start_span(name, headers=headers, attributes={
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
