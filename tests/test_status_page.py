"""The status page over HTTP: served to browsers without the key, data only with it, `/stats`.

The page itself runs in a real browser in tests/test_e2e_observability.py; here the router
runs in this process over stand-in worker processes, with `--api-key`.
"""

from __future__ import annotations

import re
import time

import pytest

from server.edge.routes.status import accepts_html
from server.fleet.history import WorkerStats, read_values
from tests.inprocess_router import inprocess_router

KEY = "page-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client():
    with inprocess_router("sm_80,sm_89,sm_90", api_key=KEY, stats_interval_s=0.2,
                          env={"FAKE_TOKEN_S": "0.005"}) as c:
        yield c


def test_the_shell_is_public_html_with_a_strict_policy_and_no_outside_resource(client):
    for path in ("/", "/status"):
        r = client.get(path, headers={"accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'sha256-" in csp
    page = r.text
    # nothing fetched from elsewhere: no external src/href, no CDN, no font or framework download
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page references another origin"
    assert "fetch(path" in page and "sessionStorage" in page and "Bearer" in page
    assert "gpu0" not in page and "fake" not in page  # the shell holds no data


def test_data_needs_the_key_and_other_accept_types_get_406(client):
    for path in ("/workers", "/stats", "/metrics"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers=AUTH).status_code == 200
    r = client.get("/", headers={"accept": "application/json"})
    assert r.status_code == 406 and "`Accept: text/html`" in r.json()["error"]
    assert client.post("/status", json={}, headers=AUTH).status_code == 405


def test_tgi_post_root_still_generates_and_needs_the_key(client):
    assert client.post("/", json={"inputs": "Hi"}).status_code == 401
    r = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["generated_text"] == " t0 t1 t2"


def _generated(stats: dict) -> int:
    return sum(w["generated_tokens"] or 0 for w in stats["workers"].values())


def test_stats_report_health_and_each_workers_recent_tokens_per_second(client):
    time.sleep(0.3)  # one sample after the earlier tests' requests
    before = _generated(client.get("/stats", headers=AUTH).json())
    for _ in range(3):
        assert client.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 40}},
                           headers=AUTH).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        stats = client.get("/stats", headers=AUTH).json()
        if _generated(stats) == before + 120 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert _generated(stats) == before + 120
    assert stats["health"]["status"] == "ok" and stats["model"] == "default_model"
    assert stats["interval_s"] == 0.2 and stats["window_s"] > 0
    assert list(stats["workers"]) == ["gpu0", "gpu1", "gpu2"]
    rates = [v for w in stats["workers"].values() for v in w["tokens_per_s"] if v]
    assert len(rates) >= 3 and all(v > 0 for v in rates)  # each request's tokens show up as a rate
    for w in stats["workers"].values():
        assert 0 <= w["kv_usage"] <= 1 and w["running"] is not None and w["waiting"] is not None


@pytest.mark.parametrize("accept, html", [
    (None, True), ("*/*", True), ("text/html", True), ("text/*;q=0.5", True),
    ("application/json", False), ("text/html;q=0, application/json", False), ("TEXT/HTML", True),
])
def test_accept_negotiation(accept, html):
    assert accepts_html(accept) is html


def test_sampler_reads_first_samples_and_marks_gaps_and_restarts():
    text = ('# TYPE x counter\nhetserve_worker_generated_tokens_total 100.0\n'
            'vllm:kv_cache_usage_perc{worker_id="gpu0",capability="8.0"} 0.25\nvllm:num_requests_running 2\n')
    assert read_values(text) == {"hetserve_worker_generated_tokens_total": 100.0,
                                 "vllm:kv_cache_usage_perc": 0.25, "vllm:num_requests_running": 2.0}
    stats = WorkerStats(lambda: [], interval_s=1.0, window_s=4.0)
    series = stats._series_of("gpu0")
    for pid, total, t in [(7, 100, 0.0), (7, 150, 1.0), (7, 250, 2.0), (None, None, 3.0), (8, 10, 4.0), (8, 40, 5.0)]:
        body = None if total is None else f"hetserve_worker_generated_tokens_total {total}\n"
        stats._record(series, pid, body, t)
    # window of 4: [100 tok/s, gap (not ready), first sample of the new process, 30 tok/s]
    assert list(series.points) == [100.0, None, None, 30.0]
