"""The worker's HTTP API (TGI shapes, errors, headers) over a fake-model engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.engine_fakes import EOS_ID, FakeRunner, tokenizer
from workers.contract import CapabilityPayload
from workers.engine.core import Engine
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.sampling.params import SamplingParams
from workers.serving.app import create_app

TOK = tokenizer()
INFO = CapabilityPayload(
    worker_id="gpu1",
    device={"type": "cuda", "index": 1, "uuid": "GPU-sim-1", "name": "NVIDIA L40S", "capability": "8.9",
            "simulated": True, "memory_total_bytes": 48 << 30},
    fp8={"convention": "native_e4m3", "reason": "capability 8.9 >= 8.9"},
    kernels={"RMSNorm": {"repo": "rmsnorm", "layer": "RMSNorm", "variant": "triton", "reason": "r"}},
    capacity={"max_sequences": 2, "max_tokens": 128, "max_seq_len": 64, "kv_cache_bytes": 1234},
    model={"id": "tiny", "dtype": "float32", "context_length": 64},
    versions={"hetserve": "0.1.0"},
)
HEADERS = {"x-worker-id": "gpu1", "x-worker-capability": "8.9", "x-fp8-convention": "native_e4m3"}


@pytest.fixture
def setup():
    runner = FakeRunner(delay=0.001)
    engine = Engine(runner, Scheduler(SchedulerConfig(2, 64, 32, eos_token_ids=(EOS_ID,))), TOK, max_queue=1)
    with TestClient(create_app(INFO, engine, TOK, drain_timeout=1.0)) as client:
        yield client, engine


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_generate_returns_tgi_shape_with_details_and_worker_headers(setup):
    client, _ = setup
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200, r.text
    assert {k: r.headers[k] for k in HEADERS} == HEADERS
    body = r.json()
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 5 and d["input_length"] == 2
    assert d["seed"] is None and d["prefill"] == [] and len(d["tokens"]) == 5
    assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert body["generated_text"] == "".join(t["text"] for t in d["tokens"] if not t["special"])
    plain = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}}).json()
    assert plain == {"generated_text": body["generated_text"]}  # greedy is reproducible
    full = client.post("/generate",
                       json={"inputs": "Hello", "parameters": {"max_new_tokens": 5, "return_full_text": True}})
    assert full.json()["generated_text"] == "Hello" + body["generated_text"]


def test_generate_stream_events_and_final_details(setup):
    client, _ = setup
    r = client.post("/generate_stream",
                    json={"inputs": "Hello", "parameters": {"max_new_tokens": 4, "seed": 3, "do_sample": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-worker-id"] == "gpu1"
    events = sse_events(r.text)
    assert [e["index"] for e in events] == [0, 1, 2, 3]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 4, "input_length": 2, "seed": 3}
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    again = sse_events(client.post("/generate_stream", json={
        "inputs": "Hello", "parameters": {"max_new_tokens": 4, "seed": 3, "do_sample": True}}).text)
    assert [e["token"]["id"] for e in again] == [e["token"]["id"] for e in events]


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"temperature": 0, "do_sample": True}, "`temperature` must be > 0 when `do_sample`"),
        ({"top_p": 0}, "`top_p` must be in (0, 1]"),
        ({"top_k": -2}, "`top_k`"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be an integer >= 1"),
        ({"max_new_tokens": "many"}, "`parameters.max_new_tokens`"),
        ({"max_new_tokens": 63}, "must be <= 64 on this worker. Given: 2 `inputs` tokens and 63 `max_new_tokens`"),
    ],
)
def test_validation_errors_are_422_in_tgi_shape(setup, parameters, needle):
    client, _ = setup
    for path in ("/generate", "/generate_stream"):
        r = client.post(path, json={"inputs": "Hello", "parameters": parameters})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error_type"] == "validation" and needle in body["error"], body
        assert r.headers["x-worker-id"] == "gpu1"


def test_missing_inputs_is_422(setup):
    client, _ = setup
    r = client.post("/generate", json={"parameters": {}})
    assert r.status_code == 422 and "`inputs`" in r.json()["error"]


def test_full_queue_answers_429_with_retry_after(setup):
    client, engine = setup
    # 2 running + 1 queued fill this worker; hold them with long generations.
    held = [engine.submit(TOK.encode("x").ids, SamplingParams.create(max_new_tokens=60)) for _ in range(3)]
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 429
    assert r.json()["error_type"] == "overloaded" and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-worker-id"] == "gpu1"
    for s in held:
        engine.abort(s.request_id)
    assert "hetserve_worker_rejected_requests_total{reason=\"overloaded\"} 1.0" in client.get("/metrics").text


def test_health_capability_metrics(setup):
    client, _ = setup
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ready"
    cap = client.get("/capability").json()
    assert set(cap) == {"worker_id", "pid", "device", "fp8", "kernels", "capacity", "model", "versions", "load",
                        "triton_cache", "compile"}  # fmt: skip
    assert cap["capacity"]["max_seq_len"] == 64 and cap["load"] == {"running": 0, "queued": 0}
    client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    text = client.get("/metrics").text
    assert 'hetserve_worker_requests_total{finish_reason="length"} 1.0' in text
    assert "hetserve_worker_generated_tokens_total 3.0" in text


# -- logprobs, prompt scoring, grammars ----------------------------------------------------------


def test_top_n_tokens_give_each_token_its_bytes_and_alternatives(setup):
    client, _ = setup
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True, "top_n_tokens": 3}}
    d = client.post("/generate", json=body).json()["details"]
    assert len(d["tokens"]) == len(d["top_tokens"]) == 4
    for token, top in zip(d["tokens"], d["top_tokens"], strict=True):
        assert bytes(token["bytes"]) == TOK.decode([token["id"]]).encode()
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"] and top[0]["logprob"] == pytest.approx(token["logprob"])  # greedy
    events = sse_events(client.post("/generate_stream", json=body).text)
    assert [len(e["top_tokens"]) for e in events] == [3] * 4 and "bytes" in events[0]["token"]


def test_prompt_scoring_with_token_ids_and_no_new_tokens(setup):
    """`max_new_tokens` 0 + `decoder_input_details`: the prompt's logprobs and nothing generated."""
    client, _ = setup
    ids = TOK.encode("Hello world").ids
    r = client.post("/generate", json={"input_ids": ids, "parameters": {
        "max_new_tokens": 0, "decoder_input_details": True, "top_n_tokens": 1}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == "" and body["input_text"] == "Hello world"
    d = body["details"]
    assert d["generated_tokens"] == 0 and d["tokens"] == [] and d["input_length"] == len(ids)
    assert [p["id"] for p in d["prefill"]] == ids and d["prefill"][0]["logprob"] is None
    assert all(p["logprob"] <= 0 and len(p["top_tokens"]) == 1 for p in d["prefill"][1:])
    r = client.post("/generate_stream",
                    json={"input_ids": ids, "parameters": {"max_new_tokens": 0, "decoder_input_details": True}})
    assert r.status_code == 422 and "`/generate`" in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 99999]}, "`input_ids` must be a non-empty list of token ids in [0, 511], got `99999`"),
        ({"inputs": "x", "input_ids": [1]}, "not both"),
        ({"inputs": "x", "parameters": {"logit_bias": {"600": 1.0}}}, "`logit_bias` token id `600` is outside"),
        ({"inputs": "x", "parameters": {"max_new_tokens": 4, "grammar": {"type": "json", "value": {"type": "wat"}}}},
         "The json schema cannot be enforced: Invalid type: wat"),
        ({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": ""}}}, "`grammar.value`"),
    ],
)
def test_bad_prompts_biases_and_grammars_are_422(setup, body, needle):
    client, _ = setup
    r = client.post("/generate", json=body)
    assert r.status_code == 422 and needle in r.json()["error"], r.text


def test_grammar_constrains_the_output(setup):
    client, _ = setup
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "json", "value": json.dumps(schema)}, "details": True}})
    assert r.status_code == 200, r.text
    assert 0 <= json.loads(r.json()["generated_text"])["n"] <= 9 and r.json()["details"]["finish_reason"] == "eos_token"


@pytest.mark.parametrize("argv,needle", [
    (["--kv-block-size", "3"], "`--kv-block-size 3` is not supported. Supported: 1, 2, 4, 8, 16"),
    (["--max-num-batched-tokens", "4", "--max-batch", "8"], "`--max-num-batched-tokens 4` must be >= `--max-batch 8`"),
    (["--kv-cache-bytes", "0"], "`--kv-cache-bytes` must be >= 1, got `0`"),
])
def test_worker_engine_flags_are_checked(argv, needle, capsys):
    from workers.main import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--socket", "/tmp/x.sock", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    args = parse_args(["--socket", "/tmp/x.sock", "--no-prefix-cache", "--kv-block-size", "32"])
    # the device decides
    assert args.no_prefix_cache and args.kv_block_size == 32 and args.max_num_batched_tokens is None


def test_a_raise_while_streaming_one_request_ends_its_stream_with_request_failed(setup, monkeypatch):
    """Guards the `except Exception` in `generate_stream`'s `sse()` (a raise while rendering
    one request's events broke its connection mid-stream, which the router reads as the
    worker's death: a migration, a breaker failure, and the request counted as a killer)."""
    from workers.contract.render import Render

    client, engine = setup
    original = Render.event

    def event(self, e):
        if e.index == 2:
            raise ValueError("a bug that only this request hits")
        return original(self, e)

    monkeypatch.setattr(Render, "event", event)
    r = client.post("/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 6}})
    events = sse_events(r.text)
    assert [e["index"] for e in events[:-1]] == [0, 1], events
    assert events[-1]["error_type"] == "request_failed" and "ValueError" in events[-1]["error"], events
    monkeypatch.setattr(Render, "event", original)
    assert client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
    assert engine.metrics is not None and engine.accepting


def test_a_raise_in_one_request_is_a_500_request_failed_and_the_worker_serves_on(setup, monkeypatch):
    """Guards `ERROR_REQUEST_FAILED` in `install_error_handlers` (any 5xx blamed the worker:
    the router retried it elsewhere and counted it against the breaker)."""
    from workers.contract.render import Render

    client, _ = setup
    original = Render.response
    monkeypatch.setattr(Render, "response", lambda self, events, details: 1 / 0)
    # the real server answers with the handler's response; TestClient re-raises unless told not to
    r = TestClient(client.app, raise_server_exceptions=False).post(
        "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 500 and r.json()["error_type"] == "request_failed", r.text
    assert "ZeroDivisionError" in r.json()["error"]
    monkeypatch.setattr(Render, "response", original)
    assert client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).status_code == 200
