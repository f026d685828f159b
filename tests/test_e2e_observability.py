"""End to end: the status page in a real browser, traces over OTLP, gateway gauges.

One `hetserve serve --simulate sm_80,sm_89,sm_90 --api-key KEY --otlp-endpoint URL` with
three real worker processes, an OTLP/HTTP receiver in this process (the collector), and
Debian's Chromium driven by Playwright (scripts/browser.sh installs the browser; the
browser test skips, saying why, where none can be had). The browser test runs last: it
kills a worker with SIGKILL and watches its card turn `restarting` and back to `ready`
without a reload. Screenshots go to $HETSERVE_ARTIFACTS (default `artifacts/`);
`HETSERVE_UPDATE_DOCS=1` also refreshes the README's `docs/status-page.png`.
"""

from __future__ import annotations

import gzip
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.router_harness import CHROMIUM_FLAGS, ROOT, RouterProcess, chromium_path

pytestmark = pytest.mark.slow
pytest.importorskip("opentelemetry.proto", reason="the tracing extra is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KEY = "status-page-key"
AUTH = {"authorization": f"Bearer {KEY}"}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ARTIFACTS = Path(os.environ.get("HETSERVE_ARTIFACTS", ROOT / "artifacts"))
class OTLPReceiver:
    """An OTLP/HTTP trace collector on loopback: keeps every span it is sent, decoded."""

    def __init__(self):
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._keep(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _keep(self, request) -> None:
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({
                        "service": resource.get("service.name"), "name": s.name, "trace": s.trace_id.hex(),
                        "span": s.span_id.hex(), "parent": s.parent_span_id.hex() or None,
                        "attributes": {a.key: _value(a.value) for a in s.attributes},
                        "events": [e.name for e in s.events],
                    })

    def wait_for(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no such span within {timeout}s; "
                             f"received: {[(s['service'], s['name']) for s in self.spans]}")


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def collector():
    receiver = OTLPReceiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def router(tmp_path_factory, collector):
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("obs") / "tiny")
    r = RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--model", str(model), "--max-batch", "8",
                       "--api-key", KEY, "--otlp-endpoint", collector.url, "--disaggregate", "auto"],
                      env={"OTEL_BSP_SCHEDULE_DELAY": "200"}, fake=False, ready_timeout=240)
    yield r
    r.stop()
    assert not r.orphans, f"workers left running: {r.orphans}"


@pytest.fixture(scope="module")
def client(router):
    with router.client(timeout=120, headers=AUTH) as c:
        yield c


def test_router_and_worker_spans_form_one_trace_across_the_socket(client, collector):
    caller_span = "00f067aa0ba902b7"
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 6, "details": True}},
                    headers={"traceparent": f"00-{CALLER_TRACE}-{caller_span}-01"})
    assert r.status_code == 200, r.text
    in_trace = lambda service: lambda s: s["trace"] == CALLER_TRACE and s["service"] == service  # noqa: E731
    (router_span,) = collector.wait_for(in_trace("hetserve-router"))
    (worker_span,) = collector.wait_for(in_trace("hetserve-worker"))
    assert router_span["name"] == "POST /generate" and router_span["parent"] == caller_span
    assert worker_span["name"] == "POST /generate" and worker_span["parent"] == router_span["span"]
    assert router_span["events"] == ["route"]
    worker, capability, fp8 = r.headers["x-worker-id"], r.headers["x-worker-capability"], r.headers["x-fp8-convention"]
    for span in (router_span, worker_span):
        a = span["attributes"]
        assert (a["hetserve.worker.id"], a["hetserve.worker.capability"], a["hetserve.fp8.convention"]) == (
            worker, capability, fp8)
    a = worker_span["attributes"]
    assert a["gen_ai.usage.completion_tokens"] == r.json()["details"]["generated_tokens"]
    assert a["hetserve.device.simulated"] is True and a["gen_ai.latency.e2e"] > 0
    assert a["gen_ai.latency.time_in_model_decode"] > 0 and a["gen_ai.latency.time_in_queue"] >= 0


def test_gateway_gauges_per_worker_and_for_the_pod(client):
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        family = families[name]
        assert family.type == "gauge"
        labels = [(s.labels["worker_id"], s.labels["capability"]) for s in family.samples]
        assert labels == [("gpu0", "8.0"), ("gpu1", "8.9"), ("gpu2", "9.0"), ("all", "all")], (name, labels)
        assert all(0 <= s.value for s in family.samples)
    assert all(s.value <= 1 for s in families["vllm:kv_cache_usage_perc"].samples)


# --- the browser -------------------------------------------------------------------------


def _future_fields(page) -> None:
    """Serve the page /workers and /stats as a router in trouble would: gpu2's breaker open and
    its canary suspect (checked 12 s ago), block counts and no KV gauge, in the real answers."""

    def workers(route):
        body = route.fetch().json()
        for w in body["workers"]:
            if w["id"] == "gpu2":
                w["breaker"] = {"state": "open", "consecutive_failures": 5, "times_opened": 1,
                                "last_failure": "stream lost mid-way", "retry_in_s": 3.2}
                w["canary"] = {"verdict": "suspect", "reason": "agreement 0.8 < 0.9 over 40 positions",
                               "expected": ">= 0.9", "agreement": 0.8, "max_logprob_diff": 0.5, "positions": 40,
                               "checked_at": round(time.time() - 12, 3),
                               "reference": {"worker": "gpu0", "model": "tiny",
                                             "recorded_at": round(time.time() - 200, 3),
                                             "deterministic": False, "dtype": "float32", "fp8": "emulated"},
                               "peers": {"gpu0": 0.8, "gpu1": 0.8}}
                w["capacity"] = {**(w["capacity"] or {}), "kv_blocks_total": 1024, "kv_blocks_free": 256,
                                 "kv_block_size": 16}
                w["preparing"] = ["C++ kernels: torch paths, building hetserve_cpu_greedy",
                                  "decode step: eager, compiling 4 of 6 buckets"]
                w["fallbacks"] = {"RMSNorm": "torch path: the chosen kernel (triton) failed on this device: "
                                             "self-test: max abs diff 0.5 > 0.01"}
        route.fulfill(json=body)

    def stats(route):
        body = route.fetch().json()
        body["workers"]["gpu2"]["kv_usage"] = None
        route.fulfill(json=body)

    page.route("**/workers", workers)
    page.route("**/stats", stats)


def _two_models(page) -> None:
    """Serve the page /workers as a router of three models would: gpu2 serving `coder` (loaded
    on demand), `big` unloaded, a fourth device free."""

    def workers(route):
        body = route.fetch().json()
        for w in body["workers"]:
            if w["id"] == "gpu2":
                w["model"]["name"] = "coder"
        base = body["models"][0]
        body["models"] = [{**base, "workers": ["gpu0", "gpu1"]},
                          {**base, "name": "coder", "workers": ["gpu2"], "loads": 2, "unloads": 1, "last_load_s": 3.2},
                          {**base, "name": "big", "state": "unloaded", "workers": [], "reason": "least recently used"}]
        body["placement"] = [*body["placement"], {"worker_id": "gpu3", "model": None, "role": "free",
                                                  "reason": "left free for models loaded on demand",
                                                  "need_bytes": None, "usable_bytes": 2 ** 30, "need": None}]
        route.fulfill(json=body)

    page.route("**/workers", workers)


def _load(router, stop: threading.Event) -> None:
    """Streamed requests in the background, so the sparklines and load bars have something to show."""
    with httpx.Client(base_url=router.url, headers=AUTH, timeout=60) as c:
        while not stop.is_set():
            try:
                with c.stream("POST", "/generate_stream", json={"inputs": "Once upon a time",
                                                                "parameters": {"max_new_tokens": 48}}) as r:
                    for _ in r.iter_bytes():
                        pass
            except httpx.HTTPError:  # the router stopping under us at the end
                return


@pytest.mark.browser
def test_status_page_in_a_real_browser_follows_a_worker_killed_and_restarted(router, client):
    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extras)")
    expect = sync_api.expect  # polls from Playwright's own world: the page's CSP forbids eval
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(router, stop), daemon=True) for _ in range(3)]
    for t in loaders:
        t.start()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 760})
            requested, errors = [], []
            page.on("request", lambda req: requested.append(req.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(router.url + "/")
            # 1. the shell asks for the key once; the data calls then carry it
            page.wait_for_selector("#keyform:not([hidden])", timeout=10_000)
            assert page.locator(".card").count() == 0
            page.fill("#keyinput", KEY)
            page.click("#keyform button")
            expect(page.locator(".card[data-state=ready]")).to_have_count(3, timeout=20_000)
            assert page.evaluate("sessionStorage.getItem('hetserve.apiKey')") == KEY
            # 2. three cards in device order, each with its own capability, fp8 path and kernels
            cards = page.locator(".card")
            assert [cards.nth(i).get_attribute("data-worker") for i in range(3)] == ["gpu0", "gpu1", "gpu2"]
            # ... in the section of the model they serve, with its state
            tiny = page.locator(".model-group[data-model=tiny]")
            expect(tiny.locator(".card")).to_have_count(3)
            expect(tiny.locator(".model-state")).to_have_text("loaded")
            assert [cards.nth(i).locator(".cap").get_attribute("data-capability") for i in range(3)] == [
                "8.0", "8.9", "9.0"]
            # without --quantize fp8 no layer computes in fp8: the fp8 row says so, and what each device
            # could run is on its capability row
            assert [cards.nth(i).locator(".fp8").get_attribute("data-used") for i in range(3)] == ["false"] * 3
            assert [cards.nth(i).locator(".fp8-conv").inner_text() for i in range(3)] == ["not used (float32)"] * 3
            assert [cards.nth(i).locator(".fp8").get_attribute("data-convention") for i in range(3)] == [""] * 3
            assert [cards.nth(i).locator(".cap").get_attribute("data-fp8") for i in range(3)] == [
                "emulated", "native_e4m3", "native_e4m3"]
            assert "sm_89" in cards.nth(1).locator(".cap").inner_text()
            assert "fp8 native e4m3" in cards.nth(1).locator(".cap").inner_text()
            # the architecture each worker reports, with what it switches on (archLabel)
            assert [cards.nth(i).locator(".arch").get_attribute("data-architecture") for i in range(3)] == ["llama"] * 3
            assert cards.nth(0).locator(".arch").inner_text() == "llama · rope default"
            assert all(cards.nth(i).locator(".sim").is_visible() for i in range(3))
            # why each device serves its model: the 48 GiB sm_89 is the smallest that holds it, replicas on the rest
            assert [cards.nth(i).locator(".placed").get_attribute("data-role") for i in range(3)] == [
                "replica", "first", "replica"]
            placed = cards.nth(1).locator(".placed").inner_text()
            assert "first · needs " in placed and "MiB of 43.2 GiB" in placed and "smallest free device" in placed
            # disaggregation's role row: `auto` does not split these cards (the H100 is faster at both
            # phases than the A100), and each card says so
            assert [cards.nth(i).locator("dd.role").get_attribute("data-role") for i in range(3)] == ["both"] * 3
            assert "not disaggregated" in cards.nth(2).locator(".role-reason").inner_text()
            gpu1 = page.locator(".card[data-worker=gpu1]")
            gpu1.locator("details.kernels summary").click()
            assert (gpu1.locator("details.kernels li").count() >= 2
                    and "8.9" in gpu1.locator(".cap").get_attribute("title"))
            assert "no `--quantize fp8`" in gpu1.locator(".fp8-reason").inner_text()
            # nothing is prepared behind the serving of a simulated device and no kernel fell back: both rows
            # hidden, and /workers says so rather than leaving the fields out
            assert not gpu1.locator("dd.preparing").is_visible() and not gpu1.locator("dd.fallbacks").is_visible()
            listed = client.get("/workers").json()["workers"]
            assert [(w["preparing"], w["fallbacks"]) for w in listed] == [([], {})] * 3
            # 3. live figures: tokens/s and KV usage sparklines, the health verdict in the header
            for i in range(3):
                expect(cards.nth(i).locator("svg.spark.tps-spark polyline").first).to_be_attached(timeout=30_000)
                expect(cards.nth(i).locator("svg.spark.kv-spark polyline").first).to_be_attached(timeout=10_000)
            expect(page.locator("#health")).to_have_text("ok")
            page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)
            # 4. kill -9 one worker: its card turns `restarting`, then `ready`, with no reload
            page.evaluate("window.__sameDocument = true")
            victim = next(w for w in client.get("/workers").json()["workers"] if w["id"] == "gpu1")
            os.kill(victim["pid"], signal.SIGKILL)
            page.wait_for_selector(".card[data-worker=gpu1][data-state=restarting]", timeout=15_000)
            expect(page.locator("#health")).to_have_text("degraded", timeout=5_000)
            page.screenshot(path=str(ARTIFACTS / "status-page-restarting.png"), full_page=True)
            page.wait_for_selector(".card[data-worker=gpu1][data-state=ready]", timeout=120_000)
            assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
            proc = gpu1.locator(".proc").inner_text()
            assert "1 restart" in proc and "killed by signal SIGKILL" in proc and str(victim["pid"]) not in proc
            expect(page.locator("#health")).to_have_text("ok", timeout=10_000)
            page.screenshot(path=str(ARTIFACTS / "status-page-after-restart.png"), full_page=True)
            if os.environ.get("HETSERVE_UPDATE_DOCS"):
                page.screenshot(path=str(ROOT / "docs" / "status-page.png"), full_page=True)
            # 5. verdicts in words, the raw numbers behind a disclosure, a block pool's KV counts
            _future_fields(page)
            gpu2 = page.locator(".card[data-worker=gpu2]")
            gpu2_health = gpu2.locator("dd.health")
            expect(gpu2_health).to_contain_text("breaker open: 5 failures in a row, retry in 3.2 s", timeout=5_000)
            expect(gpu2_health).to_contain_text(re.compile(
                r"canary suspect: agreement 0\.8 < 0\.9 over 40 positions, checked 1[0-9] s ago"))
            expect(gpu2_health.locator(".v.bad")).to_have_count(2)
            expect(gpu2).to_have_class(re.compile(r"\balert\b"))
            expect(gpu2.locator(".kv-text")).to_have_text("75.0% of 1024 blocks × 16 tokens")
            # what it still prepares behind its serving, and the kernel that failed on its device, with why
            expect(gpu2.locator("dd.preparing .v")).to_have_text([
                "C++ kernels: torch paths, building hetserve_cpu_greedy",
                "decode step: eager, compiling 4 of 6 buckets"])
            expect(gpu2.locator("dd.fallbacks .v.warn")).to_have_text([
                "RMSNorm: torch path: the chosen kernel (triton) failed on this device: self-test: max abs diff 0.5 "
                "> 0.01"])
            expect(gpu2.locator("dd.fallbacks")).to_have_attribute("data-layers", "RMSNorm")
            gpu2.locator("details.numbers summary").click()
            numbers = gpu2.locator("details.numbers .raw")
            expect(numbers).to_contain_text("max logprob diff")
            raw = numbers.inner_text()
            assert "positions\n40" in raw and "retry in\n3.2 s" in raw and "3 min ago" in raw, raw
            assert "{" not in raw and "[object" not in raw and "checked_at" not in raw, raw
            gpu0 = page.locator(".card[data-worker=gpu0]")  # the router's own verdicts
            expect(gpu0.locator("dd.health")).to_contain_text("breaker closed")
            expect(gpu0.locator("dd.health")).to_contain_text("probe ok")
            expect(gpu0).not_to_have_class(re.compile(r"\balert\b"))
            page.screenshot(path=str(ARTIFACTS / "status-page-verdicts.png"), full_page=True)
            page.unroute_all(behavior="wait")  # a handler still fetching must not fulfil a route let through
            # 6. several models: a section each, in /workers' order, a worker's card under its own model
            _two_models(page)
            coder = page.locator(".model-group[data-model=coder]")
            expect(coder.locator(".card[data-worker=gpu2]")).to_have_count(1, timeout=5_000)
            expect(page.locator(".model-group[data-model=tiny] .card")).to_have_count(2)
            assert page.locator(".model-group").evaluate_all("gs => gs.map(g => g.dataset.model)") == [
                "tiny", "coder", "big"]
            big = page.locator(".model-group[data-model=big]")
            expect(big.locator(".model-state")).to_have_text("unloaded")
            expect(big.locator(".none")).to_have_text("not loaded: the next request for it loads it")
            expect(coder.locator(".model-info")).to_contain_text("1 worker · 2 loads, 1 unload · last load 3.2 s")
            expect(page.locator("#summary")).to_contain_text("3 models (2 loaded)")
            free = page.locator("#free li[data-worker=gpu3]")
            expect(free).to_have_text("gpu3: left free for models loaded on demand")
            expect(page.locator("#free h2")).to_have_text("1 free device")
            page.screenshot(path=str(ARTIFACTS / "status-page-models.png"), full_page=True)
            page.unroute_all(behavior="wait")
            # 7. a phone-width screen: one column, nothing wider than the screen
            page.set_viewport_size({"width": 390, "height": 844})
            page.wait_for_timeout(300)
            assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
            page.screenshot(path=str(ARTIFACTS / "status-page-phone.png"), full_page=True)
            # 8. air-gapped: nothing but this server was asked for anything
            assert requested and all(u.startswith(router.url + "/") for u in requested), sorted(set(requested))
            assert not errors, errors
        finally:
            stop.set()
            browser.close()
    for t in loaders:
        t.join(timeout=60)
