"""Tracing: the router's span per request and the worker's, linked by `traceparent`.

Both sides run with the OpenTelemetry SDK's in-memory exporter: the router in this process
over stand-in worker processes (which log the `traceparent` they receive), the worker's app
over a fake-model engine. The cross-process chain with real workers and a real OTLP export
is in tests/test_e2e_observability.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")

from fastapi.testclient import TestClient  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from tests.engine_fakes import EOS_ID, FakeRunner  # noqa: E402
from tests.inprocess_router import inprocess_router  # noqa: E402
from tests.router_harness import ROOT  # noqa: E402
from tests.test_worker_api import INFO, TOK  # noqa: E402
from workers.contract.tracing import NO_TRACING, check_endpoint, http_traces_url, start_tracing  # noqa: E402
from workers.engine.core import Engine  # noqa: E402
from workers.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from workers.serving.app import create_app  # noqa: E402

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
CALLER = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _spans(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


# --- the router --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_router(tmp_path_factory):
    log = tmp_path_factory.mktemp("trace") / "traceparents.log"
    exporter = InMemorySpanExporter()
    tracing = start_tracing(None, "hetserve-router", exporter=exporter)
    with inprocess_router(tracing=tracing, env={"FAKE_TRACE_LOG": str(log), "FAKE_CRASH_IDS": "gpu0"}) as client:
        yield client, exporter, log


def _received(log) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()]


def test_router_span_continues_the_callers_trace_and_is_the_workers_parent(traced_router):
    client, exporter, log = traced_router
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, headers=CALLER)
    assert r.status_code == 200, r.text
    span = _spans(exporter, "POST /generate")[-1]
    assert _hex(span.context.trace_id, 32) == CALLER_TRACE and _hex(span.parent.span_id, 16) == CALLER_SPAN
    worker = r.headers["x-worker-id"]
    attrs = dict(span.attributes)
    assert attrs["hetserve.worker.id"] == worker and attrs["http.response.status_code"] == 200
    assert attrs["hetserve.worker.capability"] == r.headers["x-worker-capability"]
    assert attrs["hetserve.fp8.convention"] == r.headers["x-fp8-convention"] and attrs["hetserve.retries"] == 0
    route = [e for e in span.events if e.name == "route"]
    assert len(route) == 1 and route[0].attributes["hetserve.worker.id"] == worker
    # the routing decision with its reason, as the answer's `X-Hetserve-Route` names it
    assert route[0].attributes["hetserve.route.reason"].startswith(f"{r.headers['x-hetserve-route']}: ")
    # what the worker process received: this trace, with the router's span as the parent
    assert _received(log)[-1] == (worker, f"00-{CALLER_TRACE}-{_hex(span.context.span_id, 16)}-01")


def test_a_retry_is_recorded_on_the_request_span(traced_router):
    """gpu0 answers 500 to this prompt: the request is retried once, on gpu1."""
    client, exporter, _ = traced_router
    for _ in range(2):  # idle workers take turns: one of the two starts on gpu0
        r = client.post("/generate", json={"inputs": "__error_500__", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.headers["x-worker-id"] == "gpu1", r.text
    retried = [s for s in _spans(exporter, "POST /generate")[-2:] if s.attributes["hetserve.retries"]]
    assert len(retried) == 1, [dict(s.attributes) for s in _spans(exporter, "POST /generate")[-2:]]
    span = retried[0]
    assert [e.name for e in span.events] == ["route", "retry", "route"]
    retry = span.events[1].attributes
    assert retry["hetserve.worker.id"] == "gpu0" and retry["hetserve.retry.reason"] == "answered 500"
    assert span.events[2].attributes["hetserve.attempt"] == 2 and span.attributes["hetserve.worker.id"] == "gpu1"


def test_streams_and_openai_choices_are_traced_to_their_end(traced_router):
    client, exporter, log = traced_router
    r = client.post("/generate_stream", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}}, headers=CALLER)
    assert r.status_code == 200 and r.text.count("data:") == 4
    span = _spans(exporter, "POST /generate_stream")[-1]
    assert span.attributes["http.response.status_code"] == 200 and span.end_time > span.start_time
    assert _received(log)[-1][1].split("-")[2] == _hex(span.context.span_id, 16)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "n": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    span = _spans(exporter, "POST /v1/completions")[-1]
    assert [e.name for e in span.events] == ["route", "route"]  # one worker call per choice
    parents = {line[1].split("-")[2] for line in _received(log)[-2:]}
    assert parents == {_hex(span.context.span_id, 16)}


def test_unknown_paths_do_not_multiply_span_names(traced_router):
    client, exporter, _ = traced_router
    assert client.post("/no/such/route/42", json={}).status_code == 404
    span = exporter.get_finished_spans()[-1]
    assert span.name == "POST other" and span.attributes["url.path"] == "/no/such/route/42"


def test_a_stream_moving_to_another_worker_is_recorded_on_the_request_span(traced_router):
    """gpu0 dies after two tokens of this prompt: the stream moves to gpu1 (`note_migration`)."""
    client, exporter, _ = traced_router
    for _ in range(2):  # idle workers take turns: one of the two starts on gpu0
        r = client.post("/generate_stream",
                        json={"inputs": "__crash_mid_stream__", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.text.count("data:") == 4 and '"error"' not in r.text, r.text
        span = _spans(exporter, "POST /generate_stream")[-1]
        if r.headers["x-worker-id"] == "gpu0":
            break
    else:
        pytest.fail("no stream started on gpu0")
    assert [e.name for e in span.events] == ["route", "migrate", "route"]
    moved = span.events[1].attributes
    assert moved["hetserve.worker.id"] == "gpu0" and moved["hetserve.migration.tokens_sent"] == 2
    assert moved["hetserve.migration.reason"].startswith("connection lost")
    assert span.attributes["hetserve.migrations"] == 1 and span.attributes["hetserve.worker.id"] == "gpu1"


# --- the worker --------------------------------------------------------------------------


@pytest.fixture
def traced_worker():
    exporter = InMemorySpanExporter()
    engine = Engine(FakeRunner(delay=0.001), Scheduler(SchedulerConfig(2, 64, eos_token_ids=(EOS_ID,))), TOK,
                    max_queue=1)
    app = create_app(INFO, engine, TOK, drain_timeout=1.0,
                     tracing=start_tracing(None, "hetserve-worker", exporter=exporter))
    with TestClient(app) as client:
        yield client, exporter


def test_worker_span_is_the_routers_child_with_timings_tokens_and_device(traced_worker):
    client, exporter = traced_worker
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}}, headers=CALLER)
    assert r.status_code == 200, r.text
    (span,) = _spans(exporter, "POST /generate")
    assert _hex(span.context.trace_id, 32) == CALLER_TRACE and _hex(span.parent.span_id, 16) == CALLER_SPAN
    a = dict(span.attributes)
    assert (a["hetserve.worker.id"], a["hetserve.worker.capability"], a["hetserve.fp8.convention"]) == (
        "gpu1", "8.9", "native_e4m3")
    assert a["hetserve.device.simulated"] is True and a["hetserve.device.name"] == "NVIDIA L40S"
    assert a["gen_ai.usage.prompt_tokens"] == 2 and a["gen_ai.usage.completion_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.request.max_tokens"] == 5
    parts = [a[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode")]
    assert all(p >= 0 for p in parts) and parts[2] > 0  # four decode steps of >= 1 ms each
    assert a["gen_ai.latency.e2e"] == pytest.approx(sum(parts))
    assert a["gen_ai.latency.e2e"] <= (span.end_time - span.start_time) / 1e9


def test_worker_spans_cover_streams_refusals_and_untraced_callers(traced_worker):
    client, exporter = traced_worker
    r = client.post("/generate_stream", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200
    (span,) = _spans(exporter, "POST /generate_stream")
    assert span.parent is None and span.attributes["gen_ai.usage.completion_tokens"] == 3  # no caller: a new trace
    r = client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 500}}, headers=CALLER)
    assert r.status_code == 422
    (refused,) = _spans(exporter, "POST /generate")
    assert refused.status.status_code == StatusCode.ERROR and "max_new_tokens" in refused.status.description
    assert _hex(refused.parent.span_id, 16) == CALLER_SPAN


# --- off by default ----------------------------------------------------------------------


def test_tracing_off_imports_no_opentelemetry_and_adds_no_middleware():
    """Without --otlp-endpoint the router and the worker's API never import the SDK or an exporter
    (FastAPI itself imports the API package when it is installed), add no middleware, and turn
    FastAPI's own per-request instrumentation check off."""
    script = (
        "import sys, json\n"
        "from server.edge.app import create_app\n"
        "from server.config.settings import RouterSettings\n"
        "import workers.serving.app, workers.serving.tracing\n"
        "app = create_app(RouterSettings(), [])\n"
        "print(json.dumps({'otel': sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',\n"
        "                                                                       'opentelemetry.exporter'))),\n"
        "                  'middleware': [m.cls.__name__ for m in app.user_middleware]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"otel": [], "middleware": ["EdgeMiddleware", "DisconnectGuard", "DirectRoutes"]}, report
    assert NO_TRACING.inject() is None and not NO_TRACING.enabled


def test_fastapi_own_instrumentation_is_off_in_both_apps():
    """FastAPI >= 0.16x checks for a global tracer provider on every request (~15 us) unless told not to."""
    from server.config.settings import RouterSettings
    from server.edge.app import create_app as create_router_app

    engine = Engine(FakeRunner(), Scheduler(SchedulerConfig(2, 64)), TOK)
    for app in (create_router_app(RouterSettings(), []), create_app(INFO, engine, TOK)):
        if not hasattr(app, "_telemetry"):
            pytest.skip("this FastAPI has no native telemetry")
        assert not any(app._telemetry[k] for k in ("tracing", "metrics", "logs")), app._telemetry


def test_endpoint_is_checked_and_otlp_http_gets_its_traces_path():
    from server.config.settings import RouterSettings
    from server.errors import UsageError

    class Args:
        otlp_endpoint = "collector:4318"

    with pytest.raises(UsageError, match="`collector:4318`"):
        RouterSettings.from_args(Args())
    assert check_endpoint(" http://c:4318 ") == "http://c:4318"
    assert http_traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert http_traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"
