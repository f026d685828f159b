"""Nothing is lost, and the supervisor's restart rules, over stand-in workers.

One router per module with four simulated devices: gpu0 dies on the `__crash_*` prompts,
gpu3 fails to start at `kernelize` (exit code 3 + status file), gpu1 and gpu2 serve.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.router_harness import running_router, sse_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router():
    yield from running_router(
        ["--simulate", "sm_80,sm_89,sm_90,sm_75"],
        env={"FAKE_CRASH_IDS": "gpu0", "FAKE_FAIL_STEP": "kernelize", "FAKE_FAIL_IDS": "gpu3", "FAKE_TOKEN_S": "0.002"},
        expect_ready=3,
    )


@pytest.fixture(scope="module")
def client(router):
    with router.client() as c:
        yield c


def _worker(router, wid) -> dict:
    return router.worker(wid)


def _wait_ready(router, wid, timeout=30.0) -> dict:
    return router.wait_for(lambda: (w := _worker(router, wid))["state"] == "ready" and w, timeout)


_events = sse_events


def test_worker_failing_at_kernelize_is_failed_with_its_reason_not_restarted(router, client):
    w = _worker(router, "gpu3")
    assert w["state"] == "failed"
    assert w["reason"].startswith("kernelize:") and "fake failure at kernelize" in w["reason"]
    time.sleep(1.5)  # a crash loop would have respawned it by now
    again = _worker(router, "gpu3")
    assert again["state"] == "failed" and again["restarts"] == 0 and again["pid"] == w["pid"]


def test_health_is_degraded_while_a_worker_is_not_ready(client):
    body = client.get("/health").json()
    assert body["status"] == "degraded" and body["ready"] == 3 and body["workers"]["gpu3"] == "failed"


def test_constraint_matching_only_a_failed_worker_is_422(client):
    r = client.post("/generate", json={"inputs": "x"}, headers={"X-Hetserve-Worker": "gpu3"})
    assert r.status_code == 422 and "failed" in r.json()["error"]


def _gpu0_crashed(router, restarts_before: int) -> bool:
    """Whether gpu0 died since (the supervisor notices within milliseconds; allow half a second)."""
    try:
        router.wait_for(lambda: _worker(router, "gpu0")["restarts"] > restarts_before, timeout=0.5)
    except AssertionError:
        return False
    return True


def _crash_until_gpu0_restarts(router, client, path):
    """Send crashing prompts until gpu0 took one (its restarts grow); every answer must be a success."""
    _wait_ready(router, "gpu0")
    before = _worker(router, "gpu0")["restarts"]
    for _ in range(8):
        r = client.post(path, json={"inputs": "__crash_before_first__", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        assert r.headers["x-worker-id"] in ("gpu1", "gpu2")
        if path == "/generate_stream":
            events = _events(r.text)
            assert events[-1]["generated_text"] == " t0 t1 t2", events
        if _gpu0_crashed(router, before):
            break
    else:
        pytest.fail("gpu0 never took a crashing request")
    w = _wait_ready(router, "gpu0")
    assert w["restarts"] == before + 1


def test_non_streamed_request_is_retried_when_its_worker_dies_before_answering(router, client):
    _crash_until_gpu0_restarts(router, client, "/generate")


def test_stream_is_retried_when_its_worker_dies_before_the_first_token(router, client):
    _crash_until_gpu0_restarts(router, client, "/generate_stream")


def _migrations(router, wid: str) -> float:
    return router.metric("hetserve_router_worker_stream_migrations_total", worker_id=wid) or 0.0


@pytest.mark.parametrize("kind", ["tgi", "openai"])
def test_stream_under_way_moves_to_another_worker_when_its_worker_dies(router, client, kind):
    """Guards `ClientStream._move` (server/dispatch/migration.py): without it the stream ends with an
    `incomplete_generation` error event after ` t0 t1`."""
    for _ in range(12):
        _wait_ready(router, "gpu0")
        moved_before = _migrations(router, "gpu0")
        if kind == "tgi":
            r = client.post("/generate_stream",
                            json={"inputs": "__crash_mid_stream__", "parameters": {"max_new_tokens": 6}})
            events = _events(r.text)
            assert r.status_code == 200 and "error" not in events[-1], events
            assert [e["index"] for e in events] == list(range(6))  # no gap, no repeat
            assert [e["token"]["text"] for e in events] == [f" t{i}" for i in range(6)]
            assert events[-1]["generated_text"] == " t0 t1 t2 t3 t4 t5"
            moves = events[-1]["details"].get("migrations", 0)
        else:
            r = client.post("/v1/completions", json={"prompt": "__crash_mid_stream__", "max_tokens": 6, "stream": True})
            chunks = _events(r.text)
            assert r.status_code == 200 and "error" not in chunks[-1], chunks
            assert "".join(c["choices"][0]["text"] for c in chunks) == " t0 t1 t2 t3 t4 t5"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            moves = chunks[-1].get("migrations", 0)
        if r.headers["x-worker-id"] != "gpu0":
            assert moves == 0
            continue
        assert moves == 1 and _migrations(router, "gpu0") == moved_before + 1
        return
    pytest.fail("no stream landed on gpu0")


def test_a_worker_answering_500_is_retried_once_elsewhere_else_the_error_is_returned(router, client):
    for _ in range(4):
        _wait_ready(router, "gpu0")
        r = client.post("/generate", json={"inputs": "__error_500__", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.headers["x-worker-id"] in ("gpu1", "gpu2"), r.text
    r = client.post("/generate", json={"inputs": "__error_500__"}, headers={"X-Hetserve-Worker": "gpu0"})
    assert r.status_code == 500 and r.json() == {"error": "fake internal error", "error_type": "internal"}
    assert r.headers["x-worker-id"] == "gpu0"


def test_kill_9_under_load_loses_no_request_and_the_worker_comes_back(router, client):
    victim = _wait_ready(router, "gpu1")
    restarts = victim["restarts"]
    body = {"inputs": "x", "parameters": {"max_new_tokens": 100}}  # ~0.2 s each

    def one(_):
        r = client.post("/generate", json=body)
        return r.status_code, r.headers.get("x-worker-id")

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(36)]
        time.sleep(0.3)
        os.kill(victim["pid"], signal.SIGKILL)
        health = router.wait_for(lambda: (h := client.get("/health").json())["workers"]["gpu1"] != "ready" and h, 10)
        results = [f.result() for f in futures]
    assert health["status"] == "degraded"
    assert all(code == 200 for code, _ in results), results
    back = _wait_ready(router, "gpu1")
    assert back["restarts"] == restarts + 1 and back["pid"] != victim["pid"]
    assert "SIGKILL" in (back["last_exit"] or "")
