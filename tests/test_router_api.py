"""The public API of a real `hetserve serve` process over three stand-in workers.

One router per module (`--simulate sm_80,sm_89,sm_90`, workers from
tests/router_fake_worker.py), so these tests exercise the router alone: routes and shapes,
headers, balancing and constraints, JSON errors, limits and metrics.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--max-batch", "4", "--max-queue", "4"],
                      env={"FAKE_TOKEN_S": "0.001"})
    yield r
    assert r.stop() in (0, -15), r.output()  # uvicorn re-raises SIGTERM after a clean shutdown
    assert not r.orphans, f"workers left running: {r.orphans}"


@pytest.fixture(scope="module")
def client(router):
    with router.client() as c:
        yield c


def _sse(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_workers_lists_three_ready_workers_with_their_devices(client):
    workers = client.get("/workers").json()["workers"]
    assert [w["id"] for w in workers] == ["gpu0", "gpu1", "gpu2"]
    assert [w["state"] for w in workers] == ["ready"] * 3
    assert [w["device"]["capability"] for w in workers] == ["8.0", "8.9", "9.0"]
    assert [w["fp8"]["convention"] for w in workers] == ["emulated", "native_e4m3", "native_e4m3"]
    for w in workers:
        assert set(w) >= {"id", "state", "pid", "restarts", "device", "fp8", "kernels", "load"}
        assert set(w["device"]) == {"type", "index", "uuid", "name", "capability", "simulated", "memory_total_bytes",
                                    "fp8"}
        # the device's fp8 capability, not the mode in use
        assert w["device"]["fp8"]["convention"] == w["fp8"]["convention"]
        assert w["device"]["simulated"] is True and w["restarts"] == 0 and isinstance(w["pid"], int)
        assert w["load"] == {"running": 0, "queued": 0}


def test_worker_by_id_index_or_uuid_and_404_names_the_known_ids(client):
    by_id = client.get("/workers/gpu1").json()
    assert by_id["id"] == "gpu1"
    assert client.get("/workers/1").json()["id"] == "gpu1"
    assert client.get(f"/workers/{by_id['device']['uuid']}").json()["id"] == "gpu1"
    r = client.get("/workers/gpu9")
    assert r.status_code == 404 and "gpu0, gpu1, gpu2" in r.json()["error"]


def test_health_ok_when_all_ready(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["ready"] == 3


def test_generate_relays_the_worker_answer_with_worker_headers(client):
    r = client.post("/generate", json={"inputs": "a b c", "parameters": {"max_new_tokens": 3, "details": True}})
    assert r.status_code == 200
    body = r.json()
    assert body["generated_text"] == " t0 t1 t2"
    assert body["details"]["generated_tokens"] == 3 and body["details"]["finish_reason"] == "length"
    assert r.headers["x-worker-id"] in ("gpu0", "gpu1", "gpu2")
    assert r.headers["x-worker-capability"] in ("8.0", "8.9", "9.0")
    assert r.headers["x-fp8-convention"] in ("emulated", "native_e4m3")


def test_generate_stream_sends_sse_events_and_the_final_text(client):
    r = client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "x-worker-id" in r.headers
    events = _sse(r.text)
    assert [e["token"]["text"] for e in events] == [" t0", " t1", " t2", " t3"]
    assert events[-1]["generated_text"] == " t0 t1 t2 t3" and events[-1]["details"]["generated_tokens"] == 4


def test_tgi_compat_root_route_generates_or_streams(client):
    r = client.post("/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert r.json()["generated_text"] == " t0 t1"
    r = client.post("/", json={"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": True})
    assert [e["token"]["text"] for e in _sse(r.text)] == [" t0", " t1"]


def test_requests_spread_over_all_workers(client):
    def one(_):
        return client.post("/generate",
                           json={"inputs": "x", "parameters": {"max_new_tokens": 20}}).headers["x-worker-id"]

    with ThreadPoolExecutor(6) as pool:
        seen = list(pool.map(one, range(18)))
    assert set(seen) == {"gpu0", "gpu1", "gpu2"}, seen


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-Hetserve-Worker": "gpu1"}, {"gpu1"}),
        ({"X-Hetserve-Worker": "2"}, {"gpu2"}),
        ({"X-Hetserve-Min-Capability": "9.0"}, {"gpu2"}),
        ({"X-Hetserve-Min-Capability": "sm_89"}, {"gpu1", "gpu2"}),
        ({"X-Hetserve-Fp8": "emulated"}, {"gpu0"}),
        ({"X-Hetserve-Fp8": "native_e4m3", "X-Hetserve-Min-Capability": "8.9"}, {"gpu1", "gpu2"}),
    ],
)
def test_constraint_headers_choose_the_worker(client, headers, expected):
    seen = set()
    for _ in range(4):
        r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}}, headers=headers)
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-worker-id"])
    assert seen <= expected and seen


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"X-Hetserve-Worker": "gpu7"}, "gpu7"),
        ({"X-Hetserve-Min-Capability": "10.0"}, "10.0"),
        ({"X-Hetserve-Min-Capability": "fast"}, "fast"),
        ({"X-Hetserve-Fp8": "e5m2"}, "e5m2"),
        ({"X-Hetserve-Worker": "gpu0", "X-Hetserve-Fp8": "native_e4m3"}, "native_e4m3"),
    ],
)
def test_unsatisfiable_or_invalid_constraints_are_422(client, headers, needle):
    for path, body in (("/generate", {"inputs": "x"}), ("/v1/completions", {"prompt": "x", "max_tokens": 1})):
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 422, r.text
        assert needle in json.dumps(r.json())


def test_an_unknown_pinned_worker_lists_the_ids_only(client):
    """Guards `_check_pinned` in server/edge/routes/_common.py: one sentence with the known ids, not
    every worker's id, index and UUID."""
    r = client.post("/generate", json={"inputs": "x"}, headers={"X-Hetserve-Worker": "gpu7"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == ("No worker `gpu7` (X-Hetserve-Worker). Known: gpu0, gpu1, gpu2 "
                                 "(or a device index or UUID)")
    r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                    headers={"X-Hetserve-Worker": "1"})  # a device index still pins
    assert r.status_code == 200 and r.headers["x-worker-id"] == "gpu1", r.text


def test_errors_are_json_everywhere(client):
    cases = [
        (client.get("/nope"), 404),
        (client.put("/generate"), 405),
        (client.post("/generate", content=b"{not json"), 422),
        (client.post("/generate", json={"inputs": ""}), 422),
        (client.post("/generate", json={"inputs": "x", "parameters": {"temperature": -1}}), 422),
        (client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 100000}}), 422),
        (client.post("/generate", json={"inputs": "x", "parameters": {"best_of": 3}}), 422),
        (client.post("/v1/chat/completions", json={"messages": []}), 422),
        (client.get("/v1/nope"), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.headers["content-type"].startswith("application/json"), r.text
        body = r.json()
        assert "error" in body and "Traceback" not in r.text
    temp = cases[4][0].json()
    assert "`parameters.temperature`" in temp["error"] and temp["error_type"] == "validation"
    assert "context length" in cases[5][0].json()["error"]
    assert cases[8][0].json()["error"]["type"] == "not_found_error"  # OpenAI shape under /v1


def test_plain_curl_body_without_content_type_is_read_as_json(client):
    r = client.post("/generate", content=b'{"inputs": "x", "parameters": {"max_new_tokens": 1}}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413_json(client):
    big = b'{"inputs": "' + b"a" * (4 * 1024 * 1024 + 10) + b'"}'
    r = client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]

    def chunks():
        for _ in range(5):
            yield b"a" * (1024 * 1024)

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_metrics_label_every_worker_series_with_id_and_capability(client):
    client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    worker_families = [f for name, f in families.items()
                       if name.startswith("hetserve_worker_") or name.startswith("hetserve_router_worker_")]
    assert "hetserve_worker_requests" in families and "hetserve_router_worker_up" in families
    for fam in worker_families:
        for s in fam.samples:
            assert s.labels.get("worker_id") in ("gpu0", "gpu1", "gpu2"), s
            assert s.labels.get("capability") in ("8.0", "8.9", "9.0"), s
    up = {s.labels["worker_id"]: s.value for s in families["hetserve_router_worker_up"].samples}
    assert up == {"gpu0": 1.0, "gpu1": 1.0, "gpu2": 1.0}
    routes = {s.labels.get("route") for s in families["hetserve_router_requests"].samples}
    assert "/generate" in routes


def test_openapi_and_docs_are_served(client):
    spec = client.get("/openapi.json").json()
    for path in ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/models",
                 "/health", "/workers", "/workers/{worker_id}", "/metrics"):
        assert path in spec["paths"], path


def _non_loopback_ip() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outbound interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_router_binds_loopback_only(router):
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this host")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{ip}:{router.port}/health", timeout=2)


def test_a_client_leaving_mid_stream_releases_its_worker_slot(router, client):
    """Guards the stream release (`RelayResponse.__call__` and the relays' `finally`): the worker
    stream is closed and its outstanding count returns to zero when the client disconnects."""
    for _ in range(3):
        with client.stream("POST", "/generate_stream",
                           json={"inputs": "x", "parameters": {"max_new_tokens": 500}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first event
    loads = router.wait_for(lambda: all(w["load"] == {"running": 0, "queued": 0} for w in router.workers()), 10)
    assert loads
