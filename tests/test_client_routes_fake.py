"""The router's side of /tokenize, /detokenize, count_tokens and /v1/embeddings over fake
workers (tests/router_fake_worker.py): what the router sends, how it routes, how it shapes the
answer; the real workers' side is in the end-to-end tests."""

from __future__ import annotations

import base64
import struct

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

PROMPT = "word " * 300


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--simulate", "sm_80,sm_89"])
    yield r
    r.stop()


def test_counting_a_prompt_leaves_nothing_in_the_routing_prefix_index(router):
    """Guards `{"prompt": ...}` in server/edge/routes/tokenize.py and anthropic.py: a body's
    `inputs` is what routing records as a prompt cached on the worker it picks, and a count
    caches nothing (with `inputs`, the first generation after a count routed by a prefix no
    worker held)."""
    with router.client() as c:
        assert c.post("/tokenize", json={"prompt": PROMPT}).json()["count"] == 300
        counted = c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [
            {"role": "user", "content": PROMPT}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 300
        first = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        again = c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert not first.headers["x-hetserve-route"].startswith("prefix")
    assert again.headers["x-hetserve-route"].startswith("prefix")  # generation does record it


def test_detokenize_and_the_worker_headers(router):
    with router.client() as c:
        r = c.post("/detokenize", json={"tokens": [100, 101]})
    assert r.json() == {"prompt": " t0 t1"} and r.headers["x-worker-id"] in ("gpu0", "gpu1")


def test_embeddings_are_shaped_as_openai_shapes_them(router):
    with router.client() as c:
        floats = c.post("/v1/embeddings", json={"model": "m", "input": ["a b", "c"]}).json()
        packed = c.post("/v1/embeddings", json={"model": "m", "input": [[1, 2, 3]], "encoding_format": "base64"})
        cut = c.post("/v1/embeddings", json={"model": "m", "input": "x", "dimensions": 1})
    assert [d["embedding"] for d in floats["data"]] == [[3.0, 1.0], [1.0, 1.0]]
    assert floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and floats["object"] == "list"
    vector = struct.unpack("<2f", base64.b64decode(packed.json()["data"][0]["embedding"]))
    assert vector == (3.0, 1.0)
    assert cut.status_code == 400 and "`dimensions`" in cut.json()["error"]["message"]  # not matryoshka


def test_prompt_cache_key_keeps_a_conversation_on_one_worker(router):
    """Guards `prompt_cache_key` in server/protocol/responses/requests.py and its use as the
    session in server/edge/routes/responses.py (Codex sends it: it was a 400 before)."""
    with router.client() as c:
        replies = [c.post("/v1/responses", json={"model": "m", "input": f"turn {k} " * (k + 1), "store": False,
                                                 "max_output_tokens": 2, "prompt_cache_key": "conv-7"})
                   for k in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
    assert len({r.headers["x-worker-id"] for r in replies}) == 1
    assert all("session" in r.headers["x-hetserve-route"] for r in replies[1:]), [
        r.headers["x-hetserve-route"] for r in replies]


def test_openais_newer_chat_fields_are_honoured_or_refused_by_name(router):
    """Guards `prompt_cache_key`, `safety_identifier` and `store` in
    server/protocol/openai/requests.py (400s naming them before)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with router.client() as c:
        kept = [c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x " * k}],
                                                       "prompt_cache_key": "chat-3", "store": False})
                for k in range(1, 4)]
        named = c.post("/v1/chat/completions", json={**body, "safety_identifier": "user-9"})
        stored = c.post("/v1/chat/completions", json={**body, "store": True})
    assert [r.status_code for r in kept] == [200] * 3 and len({r.headers["x-worker-id"] for r in kept}) == 1
    assert "session" in kept[-1].headers["x-hetserve-route"] and named.status_code == 200
    assert stored.status_code == 422 and "`store` = `True` is not supported" in stored.json()["error"]["message"]
