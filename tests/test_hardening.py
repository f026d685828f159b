"""The second adversarial pass, end to end: no request may kill a worker, trip a breaker or pin
memory for others.

Each test reproduces one finding through real processes and HTTP, and fails without the line
its docstring names. Two routers over stand-in workers (`tests/router_fake_worker.py`) cover
the router's half (whose fault a failure is, clients that stop reading); one router over two
real workers, with a tight grammar compile budget, covers what needs the model (grammar
bombs, refusals, the byte-bounded grammar cache, the smaller findings). The in-process tests
of the compile budget are in tests/test_grammar_budget.py.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from benchmarks.load_test import rss_bytes
from tests.router_harness import RouterProcess, sse_events

pytestmark = pytest.mark.slow


def bomb(n: int) -> dict:
    """The issue's grammar bomb: compiling it is exponential in `n` (N=16 takes seconds here)."""
    return {"allOf": [{"type": "string", "pattern": f".*{chr(65 + i)}.*"} for i in range(n)]}


def post_json(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    """POST with the body as a client writes it (`\\ud800` stays an escape, as JSON allows)."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=timeout)


def breakers(r: RouterProcess) -> dict[str, dict]:
    return {w["id"]: w["breaker"] for w in r.workers()}


def closed(r: RouterProcess) -> bool:
    return all(b["state"] == "closed" and b["consecutive_failures"] == 0 for b in breakers(r).values())


def counter(r: RouterProcess, name: str) -> float:
    text = httpx.get(f"{r.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


# --- the router's half, over stand-in workers -------------------------------------------
@pytest.fixture(scope="module")
def faults():
    r = RouterProcess(["--simulate", "sm_90,sm_80"], env={"FAKE_TOKEN_S": "0.002"})
    yield r
    r.stop()
    assert not r.orphans


def test_a_request_that_raised_on_its_worker_is_a_500_not_retried_nor_held_against_the_worker(faults):
    """Guards `request_fault` in `Dispatcher._judge` and `_retry` (any 5xx counted as worker
    ill-health: a 90-byte request that raised on the worker was retried on the other and 4 of
    them opened both breakers, then ordinary clients waited 30 s or got 503)."""
    sent = counter(faults, "hetserve_router_worker_requests_total")
    retries = counter(faults, "hetserve_router_worker_retries_total")
    with faults.client() as c:
        for _ in range(8):
            r = c.post("/generate", json={"inputs": "__request_failed__", "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 500 and r.json()["error_type"] == "request_failed", r.text
        assert counter(faults, "hetserve_router_worker_requests_total") - sent == 8  # each went to one worker
        assert counter(faults, "hetserve_router_worker_retries_total") == retries
        assert closed(faults), breakers(faults)
        t0 = time.monotonic()
        assert c.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
        assert time.monotonic() - t0 < 1.0


def test_a_stream_that_fails_on_its_worker_ends_there_without_moving(faults):
    """Guards `is_request_fault(kind)` in `ClientStream._relayed` (a stream that one request
    broke moved to the next worker, which broke the same way, each loss a breaker failure)."""
    moved = counter(faults, "hetserve_router_worker_stream_migrations_total")
    with faults.client() as c:
        for _ in range(4):
            s = c.post("/generate_stream", json={"inputs": "__request_failed__", "parameters": {"max_new_tokens": 8}})
            events = sse_events(s.text)
            assert [e["token"]["id"] for e in events[:-1]] == [100, 101], events
            assert events[-1]["error_type"] == "request_failed", events
    assert counter(faults, "hetserve_router_worker_stream_migrations_total") == moved
    assert closed(faults), breakers(faults)


def test_a_request_in_flight_at_two_deaths_is_refused_then_quarantined(tmp_path):
    """Guards `Deaths.witnessed` in `Dispatcher._with_retries` and `check_quarantine` (one
    request that killed its worker was sent to the next, six worker kills in a row, then a 503
    after 262 s)."""
    r = RouterProcess(["--simulate", "sm_90,sm_80,sm_89"], env={"FAKE_CRASH_IDS": "gpu0,gpu1,gpu2"})
    try:
        body = {"inputs": "__crash_before_first__", "parameters": {"max_new_tokens": 4}}
        with r.client() as c:
            first = c.post("/generate", json=body)
            assert first.status_code == 422 and "may be what kills them" in first.text, first.text
            restarts = sum(w["restarts"] for w in r.workers())
            r.wait_for(lambda: all(w["state"] == "ready" for w in r.workers()), timeout=60)
            assert restarts + sum(w["state"] != "ready" for w in r.workers()) <= 2  # two deaths, not three
            again = c.post("/generate", json=body)  # the same request: refused before any worker sees it
            assert again.status_code == 422 and "may be what kills them" in again.text
            assert sum(w["restarts"] for w in r.workers()) == restarts
            assert c.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
            # a stream: moved once at the first death, refused at the second (ClientStream._move)
            r.wait_for(lambda: all(w["state"] == "ready" for w in r.workers()), timeout=60)
            stream = {"inputs": "__crash_mid_stream__", "parameters": {"max_new_tokens": 6}}
            events = sse_events(c.post("/generate_stream", json=stream).text)
            assert [e["token"]["id"] for e in events[:-1]] == [100, 101], events  # nothing repeated, then the end
            assert "may be what kills them" in events[-1]["error"], events[-1]
            r.wait_for(lambda: all(w["state"] == "ready" for w in r.workers()), timeout=60)
            killed = sum(w["restarts"] for w in r.workers())
            assert killed - restarts <= 2
            again = c.post("/generate_stream", json=stream)
            assert again.status_code == 422 and "may be what kills them" in again.text, again.text
            assert sum(w["restarts"] for w in r.workers()) == killed
    finally:
        r.stop()


def test_workers_the_router_stopped_for_a_stall_do_not_mark_their_requests(tmp_path):
    """Guards `worker.crashed_under(...)` in `ClientStream._move` (and `Dispatcher._with_retries`):
    a stream in flight on workers the router replaced for stalling (as a loaded host makes them
    seem) was refused and quarantined as a killer of workers at the second replacement."""
    r = RouterProcess(["--simulate", "sm_90,sm_80,sm_89", "--stall-timeout", "1", "--migration-limit", "2"],
                      env={"FAKE_CRASH_IDS": "gpu0,gpu1,gpu2"})
    try:
        stream = {"inputs": "__stall_mid_stream__", "parameters": {"max_new_tokens": 6}}
        with r.client() as c:
            events = sse_events(c.post("/generate_stream", json=stream).text)
            assert events[-1]["error_type"] == "incomplete_generation", events[-1]
            assert "may be what kills them" not in events[-1]["error"], events[-1]
            r.wait_for(lambda: all(w["state"] == "ready" for w in r.workers()), timeout=60)
            hung = [w["last_exit"] for w in r.workers() if w["restarts"]]
            assert len(hung) >= 2 and all(e.startswith("hung: engine stalled") for e in hung), hung
            again = c.post("/generate_stream", json=stream)  # not quarantined: it reaches a worker again
            assert again.status_code == 200 and "may be what kills them" not in again.text, again.text
    finally:
        r.stop()


_DEEP_FIELDS = {  # where free-form JSON rides in a request -> (path, body with %s for the value)
    "chat_template_kwargs": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"max_tokens": 2, "chat_template_kwargs": {"x": %s}}'),
    "tools.function.parameters": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                                  '"max_tokens": 2, "tools": [{"type": "function", "function": {"name": "f", '
                                  '"parameters": %s}}]}'),
    "grammar.value": ("/generate", '{"inputs": "x", "parameters": {"grammar": {"type": "json", "value": %s}}}'),
    "guided_json": ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "guided_json": %s}'),
}


@pytest.mark.parametrize("field", list(_DEEP_FIELDS))
def test_deeply_nested_values_are_refused_at_the_edge_naming_the_field(faults, field):
    """Guards `check_json_value` (a body nested about 960 deep reached Python's recursion
    limit on its way to the worker: a `RecursionError`, a 500)."""
    path, template = _DEEP_FIELDS[field]
    for depth in (900, 1200):  # within Python's JSON parser, and past it
        body = template % ('{"a":' * depth + "1" + "}" * depth)
        r = httpx.post(f"{faults.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code in (400, 422), (depth, r.text[:300])
        if depth == 900:
            assert r.status_code == 422 and f"`{field}` nests deeper than 64 levels" in r.text, r.text[:300]


@pytest.mark.parametrize("key", ["²", "١٢", "1" * 4300, "\\ud800", "-1"])
def test_logit_bias_keys_are_ascii_token_ids_or_a_named_422(faults, key):
    """Guards the key check of `logit_bias` at the edge (`"²"`, a 4,300-digit key and a lone
    surrogate were 500s, the last because the 422 echoed it and failed to encode; `"١٢"` was
    taken as token 12)."""
    body = '{"prompt": "x", "max_tokens": 2, "logit_bias": {"' + key + '": 1}}'  # a surrogate stays an escape
    r = httpx.post(f"{faults.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text[:300]
    message = r.json()["error"]["message"]
    assert "`logit_bias` keys must be token ids" in message and len(message) < 400, message


# --- clients that do not read ------------------------------------------------------------
PAD = 16384  # bytes of text per token event: a stream of 512 tokens is 8 MiB


def slow_reader_router(write_timeout: float, slots: int = 2) -> RouterProcess:
    """A stand-in worker whose token events carry `PAD` bytes each, `slots` admission slots."""
    return RouterProcess(["--simulate", "sm_90", "--write-timeout", str(write_timeout), "--max-batch",
                          str(slots // 2), "--max-queue", str(slots - slots // 2)],
                         env={"FAKE_TOKEN_S": "0.0005", "FAKE_PAD_BYTES": str(PAD)})


def _non_reader(port: int, path: str, body: dict) -> socket.socket:
    """A client that sends its request and never reads a byte of the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


def _stream(n: int) -> dict:
    return {"inputs": "hello", "parameters": {"max_new_tokens": n}}


def _generated(r: RouterProcess) -> float:
    return counter(r, "hetserve_worker_generated_tokens_total")


def _settled(r: RouterProcess, quiet_s: float = 0.3) -> float:
    """The worker's generated tokens once they stop growing for `quiet_s`."""
    last, deadline = _generated(r), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = _generated(r)
        if now == last:
            return now
        last = now
    raise AssertionError("the worker never stalled")


def test_clients_that_stop_reading_are_cut_off_and_free_their_slots():
    """Guards `_write_timed_out` in `EdgeHttpProtocol` and the bounded `ByteQueue` of
    `ClientStream` (2 clients that did not read kept their admission slots for as long as they
    hung, everyone else got 429 with the engines idle, and 20 of them took the router from 99
    to 283 MiB, never released)."""
    r = slow_reader_router(1, slots=4)
    try:
        before_rss, before_cuts = rss_bytes(r.proc.pid), counter(r, "hetserve_router_client_write_timeouts_total")
        socks = [_non_reader(r.port, "/generate_stream", _stream(512)) for _ in range(2)]
        socks.append(_non_reader(r.port, "/v1/completions", {"prompt": "hello", "max_tokens": 512, "n": 2,
                                                              "stream": True}))  # the OpenAI merge of 2 choices
        r.wait_for(lambda: counter(r, "hetserve_router_client_write_timeouts_total") - before_cuts == 3,
                   timeout=15, interval=0.2)
        # 4 x 8 MiB were asked for: about 13 MiB held here (a buffer per stream and merge, the transports),
        # 43 MiB and growing with unbounded buffers
        assert rss_bytes(r.proc.pid) - before_rss < 26 << 20
        assert _generated(r) < 4 * 512  # the worker was held back, then its requests cancelled
        r.wait_for(lambda: r.workers()[0]["load"]["running"] == 0, timeout=5, interval=0.1)
        with r.client() as c:  # every slot is free again
            assert [c.post("/generate", json=_stream(2)).status_code for _ in range(4)] == [200] * 4
        for s in socks:
            s.close()
    finally:
        r.stop()


def test_a_finished_answer_frees_its_slot_before_its_client_reads_it():
    """Guards `self.stream.finish()` at the final event in `ClientStream._relayed` (the
    ticket ended only when the relay closed, so an answer the worker had finished but its
    client had not read kept an admission slot: 2 such clients at capacity 2 gave everyone
    else 429)."""
    r = slow_reader_router(60)
    try:
        # how far a stream gets while its client reads nothing: the socket buffers, the
        # router's 1 MiB read-ahead and the worker's own buffers
        probe = _non_reader(r.port, "/generate_stream", _stream(512))
        stalled = _settled(r)
        probe.close()
        r.wait_for(lambda: r.workers()[0]["load"]["running"] == 0, timeout=5, interval=0.1)
        # a stream that ends inside the read-ahead: past what the sockets hold, so the relay
        # cannot end before its client reads, but its last event reaches the router
        n = int(stalled) - (5 << 20) // 4 // PAD
        before = _generated(r)
        socks = [_non_reader(r.port, "/generate_stream", _stream(n)) for _ in range(2)]
        r.wait_for(lambda: _generated(r) - before == 2 * n, timeout=10)
        time.sleep(0.3)
        with r.client() as c:
            answers = [c.post("/generate", json=_stream(2)) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200], (n, stalled, [a.text for a in answers])
        for s in socks:
            s.close()
    finally:
        r.stop()
