"""Responses history (`previous_response_id`) through a real `hetserve serve`: bounded in items
and bytes, counted as held, and kept off the router's event loop.

The finding: a chain of requests each adding 9,999 empty `reasoning` items (they cost no
context, so nothing refused them) grew the router from 73 to 298 MB over 12 requests while
about 29 MB were counted, and each request parsed and re-serialized the whole history on the
event loop (`/health` answered in up to 1.18 s). Stand-in workers (`tests/router_fake_worker.py`)
answer at once, so what is measured is the router's own work.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from benchmarks.load_test import rss_bytes
from server.protocol.responses.store import ENTRY_BYTES, MAX_CONVERSATION_BYTES, MAX_CONVERSATION_ITEMS
from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

EMPTY = {"type": "reasoning", "summary": []}
ASK = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--simulate", "sm_90"], env={"FAKE_TOKEN_S": "0"})
    yield r
    r.stop()
    assert not r.orphans


def respond(r: RouterProcess, items: list[dict], previous: str | None = None) -> httpx.Response:
    body = {"model": "m", "input": items, "max_output_tokens": 2, **({"previous_response_id": previous}
                                                                     if previous else {})}
    return httpx.post(f"{r.url}/v1/responses", content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json"})


def stored_bytes(r: RouterProcess) -> float:
    return r.metric("hetserve_router_responses_stored_bytes")


def test_a_chain_of_empty_reasoning_items_is_refused_at_the_item_bound(router):
    """Guards `check_conversation`'s item bound (server/protocol/responses/store.py): the chain
    of the finding was served at every step."""
    first = respond(router, [*[EMPTY] * 9_999, ASK])
    assert first.status_code == 200, first.text[:300]
    held = 10_000 + len(first.json()["output"])
    second = respond(router, [*[EMPTY] * 9_999, ASK], first.json()["id"])
    assert second.status_code == 400, second.text[:300]
    message = second.json()["error"]["message"]
    assert f"holds {held} items and `input` 10000: more than the {MAX_CONVERSATION_ITEMS} items" in message
    assert f"`{first.json()['id']}`" in message
    small = respond(router, [ASK], respond(router, [ASK]).json()["id"])  # a short chain goes on
    assert small.status_code == 200, small.text[:300]


def test_a_chain_past_the_byte_bound_is_refused_naming_it(router):
    """Guards `check_conversation`'s byte bound: reasoning text reaches no prompt (no earlier
    turn's reasoning is rendered here), so only this bound stops the chain."""
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "x" * 1_000_000}]}
    previous, status, answers = None, 200, 0
    while status == 200:
        r = respond(router, [thought, thought, thought, ASK], previous)
        status, answers = r.status_code, answers + 1
        previous = r.json()["id"] if status == 200 else previous
        assert answers <= MAX_CONVERSATION_BYTES // 3_000_000 + 1
    assert status == 400 and answers == MAX_CONVERSATION_BYTES // 3_000_000 + 1, r.text[:300]
    bound = f"more than the {MAX_CONVERSATION_BYTES} bytes a stored conversation may hold"
    assert bound in r.json()["error"]["message"]
    assert httpx.get(f"{router.url}/v1/responses/{previous}", timeout=30).status_code == 200


def test_the_stored_bytes_reported_are_what_the_router_holds(router):
    """Guards `Stored` keeping JSON bytes and counting `len` of them: parsed items cost the
    router about 8 times the characters counted. Each of 24 responses stores 10,000 empty
    reasoning items; the router's resident memory grows by about what `/metrics` reports (after
    4 such requests, whose parsing leaves the allocator its working memory)."""
    for _ in range(4):
        assert respond(router, [*[EMPTY] * 9_999, ASK]).status_code == 200
    before_rss, before = rss_bytes(router.proc.pid), stored_bytes(router)
    ids = []
    for _ in range(24):
        r = respond(router, [*[EMPTY] * 9_999, ASK])
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    grown_rss, grown = rss_bytes(router.proc.pid) - before_rss, stored_bytes(router) - before
    responses = sum(len(httpx.get(f"{router.url}/v1/responses/{rid}", timeout=30).content) for rid in ids)
    items = len(json.dumps([EMPTY] * 9_999 + [ASK], separators=(",", ":")))  # each conversation's input
    assert responses + 24 * (items + ENTRY_BYTES) < grown < responses + 24 * (items + ENTRY_BYTES + 400), grown
    assert grown_rss < 2 * grown + 16 * 2**20, (grown_rss, grown)


def test_health_answers_while_long_histories_are_processed(router):
    """Guards the worker thread of `_respond` (server/edge/routes/responses.py): the history's
    parsing, checks, prompt and serialization ran on the event loop, and `/health` waited."""
    long = respond(router, [*[EMPTY] * 9_990, ASK])
    assert long.status_code == 200
    waits, stop = [], threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                t0 = time.monotonic()
                client.get(f"{router.url}/health")
                waits.append(time.monotonic() - t0)
                time.sleep(0.01)

    side = threading.Thread(target=poll)
    side.start()
    try:
        for _ in range(6):  # a short input each time: what the loop would parse is the history
            assert respond(router, [ASK], long.json()["id"]).status_code == 200
    finally:
        stop.set()
        side.join()
    # each request parsed about 10,000 items on the loop: /health waited 0.3-0.5 s here
    assert len(waits) > 10 and max(waits) < 0.25, sorted(waits)[-5:]
