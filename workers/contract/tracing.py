"""OpenTelemetry tracing, shared by the router and the workers; off unless asked for.

Design: `hetserve serve --otlp-endpoint URL` turns it on in every process, each building its own
`Tracing` (a tracer provider named `hetserve-router` or `hetserve-worker`, exporting OTLP in
batches from a background thread); a request's trace crosses the worker socket as a W3C
`traceparent` header, so the worker's span is a child of the router's. Off (the default) is
`NO_TRACING`: callers read its `enabled` flag and opentelemetry is never imported, and FastAPI's
own instrumentation is turned off in both apps (`fastapi_telemetry_off`). Trade-off: spans leave
in batches (`OTEL_BSP_SCHEDULE_DELAY`), so a process killed with SIGKILL loses its last batch; a
clean stop flushes it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, what crosses the worker socket
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
_INSTALL_HINT = "install the tracing extra: pip install 'hetserve[tracing]'"


class TracingUnavailable(RuntimeError):
    """`--otlp-endpoint` was given but opentelemetry (or the exporter) is not installed."""


def check_endpoint(url: str) -> str:
    """The OTLP endpoint as given, or a `ValueError` naming what is accepted."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"Invalid OTLP endpoint `{url}`. Accepted: an http(s) URL such as "
                         "http://collector:4318 (OTLP/HTTP) or http://collector:4317 with "
                         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc")
    return url.strip()


def otlp_protocol(environ: Mapping[str, str] = os.environ) -> str:
    """The OTLP protocol from the standard OpenTelemetry variables (default http/protobuf)."""
    value = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    value = (value or "http/protobuf").strip().lower()
    if value not in OTLP_PROTOCOLS:
        raise ValueError(f"Unsupported OTLP protocol `{value}`. Supported: {', '.join(OTLP_PROTOCOLS)}")
    return value


def http_traces_url(endpoint: str) -> str:
    """OTLP/HTTP posts to `<endpoint>/v1/traces` when the endpoint names no path (as
    OTEL_EXPORTER_OTLP_ENDPOINT does); a URL with a path is used as it is."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class Tracing:
    """One process's tracer, or the disabled stand-in (`NO_TRACING`).

    Callers check `enabled` before anything else; every other method assumes it is True.
    """

    def __init__(self, tracer=None, provider=None):
        self.tracer = tracer
        self.provider = provider
        self.enabled = tracer is not None

    def start_span(self, name: str, *, headers: Mapping[str, str] | None = None, attributes: Mapping | None = None):
        """A SERVER span whose parent is the trace context in `headers` (none: a new trace)."""
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        context = extract(headers) if headers is not None else None
        return self.tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=dict(attributes or {}))

    def use_span(self, span):
        """Context manager: `span` is the current span inside (it is not ended on exit)."""
        from opentelemetry.trace import use_span

        return use_span(span, end_on_exit=False)

    @staticmethod
    def current_span():
        from opentelemetry.trace import get_current_span

        return get_current_span()

    def inject(self) -> dict[str, str] | None:
        """The current trace context as headers for the next hop (None when disabled)."""
        if not self.enabled:
            return None
        from opentelemetry.propagate import inject

        carrier: dict[str, str] = {}
        inject(carrier)
        return carrier

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (idempotent)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


NO_TRACING = Tracing()


def fastapi_telemetry_off() -> dict:
    """`FastAPI(**...)` arguments that turn FastAPI's own OpenTelemetry instrumentation off.

    Recent FastAPI versions look for a global tracer provider on every request once
    opentelemetry is installed (its cost: docs/benchmarks.md, "Worker latency"); hetserve makes
    its own spans, and only with `--otlp-endpoint`. Older FastAPI versions take no such argument.
    """
    import inspect

    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def _exporter(endpoint: str):
    protocol = otlp_protocol()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=http_traces_url(endpoint))
    except ImportError as e:
        package = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "the tracing extra"
        raise TracingUnavailable(f"`--otlp-endpoint` with OTLP {protocol} needs {package}: {e}") from e


def start_tracing(endpoint: str | None, service: str, attributes: Mapping | None = None,
                  exporter=None) -> Tracing:
    """`NO_TRACING` without an endpoint or exporter; else a tracer exporting to it.

    `exporter` (a span exporter object, e.g. the SDK's in-memory one in tests) replaces the
    OTLP exporter and is fed synchronously, so a test sees each span as soon as it ends.
    """
    if endpoint is None and exporter is None:
        return NO_TRACING
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as e:
        raise TracingUnavailable(f"`--otlp-endpoint` needs opentelemetry ({_INSTALL_HINT}): {e}") from e
    resource = Resource.create({"service.name": service, **dict(attributes or {})})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter(check_endpoint(endpoint))))
    return Tracing(provider.get_tracer("hetserve"), provider)
