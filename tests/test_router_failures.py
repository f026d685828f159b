"""Broken and hung workers over stand-in worker processes: circuit breakers, stall detection,
and streams that no worker can finish.

One router for most of the module with three simulated devices: gpu0 stalls or dies on the
`__stall_*` / `__crash_*` prompts, gpu2 answers 500 to every generation request, gpu1 serves.
Breaker and stall thresholds are lowered by their flags so that the tests run in seconds.
"""

from __future__ import annotations

import time

import pytest

from tests.inprocess_router import inprocess_router
from tests.router_harness import metric_value, running_router, sse_events

pytestmark = pytest.mark.slow

COOLDOWN_S = 4.0


@pytest.fixture(scope="module")
def router():
    yield from running_router(
        ["--simulate", "sm_80,sm_89,sm_90", "--stall-timeout", "1", "--breaker-failures", "2",
         "--breaker-cooldown", str(COOLDOWN_S)],
        env={"FAKE_CRASH_IDS": "gpu0", "FAKE_ERROR_IDS": "gpu2", "FAKE_TOKEN_S": "0.002"},
    )


@pytest.fixture(scope="module")
def client(router):
    with router.client() as c:
        yield c


_events = sse_events


def _worker(router, wid) -> dict:
    return router.worker(wid)


def _sent_to(router, wid: str) -> float:
    return router.metric("hetserve_router_worker_requests_total", worker_id=wid) or 0.0


def _served_without_gpu2(client, n: int) -> None:
    for i in range(n):
        if i % 2:
            r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200 and r.json()["generated_text"] == " t0 t1 t2", r.text
        else:
            r = client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200 and _events(r.text)[-1]["generated_text"] == " t0 t1 t2", r.text
        assert r.headers["x-worker-id"] != "gpu2"


def test_a_worker_answering_500_to_everything_is_isolated_by_its_breaker(router, client):
    """Guards the breaker check in `server/routing/filter.py` `eligible` and `Dispatcher._judge`: without them every
    third request goes to gpu2 first (and a request that meets two 5xx fails)."""
    # 1. Clients see no error while gpu2 fails requests; two failures in a row open its breaker.
    for _ in range(10):
        _served_without_gpu2(client, 2)
        if _worker(router, "gpu2")["breaker"]["times_opened"]:
            break
    w = _worker(router, "gpu2")
    assert w["state"] == "ready" and w["breaker"]["state"] == "open", w["breaker"]
    assert w["breaker"]["last_failure"] == "answered 500" and w["breaker"]["retry_in_s"] > 0
    health = client.get("/health").json()
    assert health["status"] == "degraded" and health["open_breakers"] == ["gpu2"]
    assert router.metric("hetserve_router_worker_breaker_state", worker_id="gpu2", state="open") == 1.0
    # 2. While it is open, gpu2 gets nothing.
    sent, opened = _sent_to(router, "gpu2"), w["breaker"]["times_opened"]
    _served_without_gpu2(client, 6)
    if _worker(router, "gpu2")["breaker"]["state"] == "open":  # (a loaded machine may outlast the cool-down)
        assert _sent_to(router, "gpu2") == sent
    # 3. After the cool-down exactly one request probes it; it fails, so the breaker opens again.
    router.wait_for(lambda: _worker(router, "gpu2")["breaker"]["state"] == "half_open", timeout=COOLDOWN_S + 5)
    sent = _sent_to(router, "gpu2")
    _served_without_gpu2(client, 4)
    assert _sent_to(router, "gpu2") == sent + 1
    again = _worker(router, "gpu2")["breaker"]
    assert again["state"] == "open" and again["times_opened"] == opened + 1


def test_a_stalled_engine_is_replaced_and_its_stream_moves(router, client):
    """Guards the stall verdict in `probe.judge` (pending work, no step for `--stall-timeout`):
    without it the stream waits on gpu0 forever, as gpu0 still answers its probes."""
    for _ in range(12):
        router.wait_for(lambda: _worker(router, "gpu0")["state"] == "ready", timeout=30)
        started = time.monotonic()
        r = client.post("/generate_stream",
                        json={"inputs": "__stall_mid_stream__", "parameters": {"max_new_tokens": 6}})
        took = time.monotonic() - started
        events = _events(r.text)
        assert r.status_code == 200 and [e["token"]["text"] for e in events] == [f" t{i}" for i in range(6)], events
        if r.headers["x-worker-id"] != "gpu0":
            continue
        assert events[-1]["details"]["migrations"] == 1
        assert took < 1 + 1 + 5, f"the stall took {took:.1f}s to detect"  # stall timeout + probe interval + slack
        back = router.wait_for(lambda: (w := _worker(router, "gpu0"))["state"] == "ready" and w["restarts"] and w,
                               timeout=30)
        assert back["last_exit"].startswith("hung: engine stalled: work pending and no step for"), back["last_exit"]
        return
    pytest.fail("no stream landed on gpu0")


def test_a_stream_no_worker_can_continue_ends_with_a_clear_error_event():
    """Guards `StreamIncomplete` in `ClientStream._move`: the only candidate (pinned) is gone and
    is not back within the wait, so the client gets what it has and one error event that says why."""
    with inprocess_router("sm_80,sm_90", env={"FAKE_CRASH_IDS": "gpu0"}, ready_wait_s=1.0,
                          restart_backoff_initial_s=60.0) as client:
        r = client.post("/generate_stream", headers={"X-Hetserve-Worker": "gpu0"},
                        json={"inputs": "__crash_mid_stream__", "parameters": {"max_new_tokens": 6}})
        events = _events(r.text)
        assert [e["token"]["text"] for e in events[:-1]] == [" t0", " t1"]
        error = events[-1]
        assert error["error_type"] == "incomplete_generation", error
        assert error["error"].startswith("worker gpu0 was lost after 2 tokens (connection lost")
        assert "no worker could continue it: No worker available" in error["error"]
        errors = metric_value(client.get("/metrics").text, "hetserve_router_worker_stream_errors_total",
                              worker_id="gpu0")
        assert errors == 1.0


def test_migration_limit_zero_ends_a_lost_stream_with_an_error_event():
    """Guards the `--migration-limit` check in `ClientStream._move`."""
    with inprocess_router("sm_80", env={"FAKE_CRASH_IDS": "gpu0"}, migration_limit=0) as client:
        r = client.post("/v1/completions", json={"prompt": "__crash_mid_stream__", "max_tokens": 6, "stream": True})
        chunks = _events(r.text)
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == " t0 t1"
        assert chunks[-1]["error"]["type"] == "incomplete_generation"
        assert "stream migration is off (--migration-limit 0)" in chunks[-1]["error"]["message"]
