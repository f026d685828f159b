"""vLLM's extra request fields and its tokenizer routes, end to end against a real `hetserve
serve` on the embedded model: each field is honoured (its effect asserted, not its acceptance)
or refused by name, never ignored.

`vllm bench serve` sends `ignore_eos` and counts the tokens it gets back, so `ignore_eos`
must give exactly `max_tokens` tokens where the model would have stopped sooner; its request
bodies are sent here as it sends them (raw SSE over httpx). `/tokenize` and `/detokenize`
answer in vLLM's shapes, with counts equal to what generation sees. `huggingface_hub`'s
client speaks the same server. With `--lenient-params` an unimplemented field is a `Warning`
header instead of a 400 (a fake worker serves that router: only the edge is under test).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.router_harness import RouterProcess, running_router
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

ASK = [{"role": "user", "content": "Tell me a fortune"}]  # greedy: `You know a fortune cookie.`, 7 tokens, EOS
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--dtype", "float32", "--max-batch", "8"], fake=False, ready_timeout=240)


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=router.url, timeout=120) as h:
        yield h


def _sse(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_ignore_eos_gives_exactly_max_tokens_where_the_model_would_stop(client):
    natural = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 40
    forced = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert (forced.choices[0].finish_reason, forced.usage.completion_tokens) == ("length", 40)
    assert forced.choices[0].message.content.startswith(natural.choices[0].message.content)
    done = client.completions.create(model="m", prompt=PROMPT, max_tokens=200, temperature=0)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 200
    past = client.completions.create(model="m", prompt=PROMPT, max_tokens=200, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert (past.choices[0].finish_reason, past.usage.completion_tokens) == ("length", 200)


def test_vllm_bench_serve_request_shapes_count_every_token(http):
    """The bodies of `vllm bench serve --ignore-eos` (openai-completions and openai-chat backends)."""
    completions = {"model": "m", "prompt": PROMPT, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 64,
                   "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = _sse(http, "/v1/completions", completions)
    assert events[-1]["usage"]["completion_tokens"] == 64
    text = "".join(c["text"] for e in events for c in e.get("choices") or ())
    assert text and [c["finish_reason"] for e in events for c in e.get("choices") or () if c["finish_reason"]] == [
        "length"]
    chat = {"model": "m", "messages": ASK, "temperature": 0.0, "max_completion_tokens": 48, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = _sse(http, "/v1/chat/completions", chat)
    assert events[-1]["usage"]["completion_tokens"] == 48


def test_min_tokens_stop_token_ids_and_the_stop_text(client, http):
    kw = dict(model="m", messages=ASK, max_tokens=64, temperature=0)
    natural = client.chat.completions.create(**kw)
    at_least = client.chat.completions.create(**kw, extra_body={"min_tokens": 20})
    assert natural.usage.completion_tokens < 20 <= at_least.usage.completion_tokens
    text = natural.choices[0].message.content
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    stop = ids[3]  # the fourth token of the answer ends it
    before = http.post("/detokenize", json={"tokens": ids[:3]}).json()["prompt"]
    cut = client.chat.completions.create(**kw, extra_body={"stop_token_ids": [stop]})
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason, cut.usage.completion_tokens) == (
        before, "stop", 4)
    kept = client.chat.completions.create(**kw, extra_body={"stop_token_ids": [stop],
                                                            "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == http.post("/detokenize", json={"tokens": ids[:4]}).json()["prompt"]
    word = text.split()[2]
    strings = client.chat.completions.create(**kw, stop=[word], extra_body={"include_stop_str_in_output": True})
    assert strings.choices[0].message.content == text[:text.index(word) + len(word)]
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(**{**kw, "max_tokens": 4}, extra_body={"min_tokens": 50})
    assert "`min_tokens`" in e.value.message and "`50`" in e.value.message


def test_skip_special_tokens_and_the_sampling_filters_change_the_answer(client):
    kw = dict(model="m", prompt="Tell me a fortune", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    raw = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    assert "<|eos|>" in raw.choices[0].text and "<|eos|>" not in plain
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    sampled = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=3)
    assert sampled.choices[0].text != greedy  # so the filters below are what makes it greedy
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        filtered = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=3,
                                             extra_body=extra)
        assert filtered.choices[0].text == greedy, extra
    penalized = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"repetition_penalty": 1.8})
    assert penalized.choices[0].text != greedy


def test_prompt_logprobs_score_every_prompt_token(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token, entry in zip(ids[1:], scored[1:], strict=True):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0
        assert len(entry) <= 2  # the token itself and the one best alternative


def test_tokenize_and_detokenize_answer_what_generation_sees(client, http):
    t = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"].endswith(PROMPT)
    generated = client.completions.create(model="m", prompt=PROMPT, max_tokens=1)
    assert generated.usage.prompt_tokens == t["count"]
    chat = http.post("/tokenize", json={"messages": ASK}).json()
    answer = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    bare = http.post("/tokenize", json={"messages": ASK, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]


def test_tokenizer_routes_refuse_bad_input_in_openais_shape_naming_the_value(http):
    """Guards the `/tokenize`, `/detokenize` paths in server/edge/errors.py `error_body`: vLLM's
    routes answer OpenAI's error shape (they answered TGI's before)."""
    for path, body, needle in (("/detokenize", {"tokens": [10**9]}, "`1000000000`"),
                               ("/detokenize", {"tokens": ["a"]}, "`tokens.0`"),
                               ("/tokenize", {"prompt": "x", "messages": ASK}, "exactly one"),
                               ("/tokenize", {"prompt": "x", "continue_final_message": True},
                                "`continue_final_message`"),
                               ("/tokenize", {"prompt": "x", "frobnicate": 1}, "`frobnicate`")):
        r = http.post(path, json=body)
        assert r.status_code in (400, 422), (path, body)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and needle in error["message"], (path, body, error)


def test_huggingface_hub_client_speaks_the_same_server(router, client):
    hf = InferenceClient(base_url=router.url, timeout=120)
    chat = hf.chat_completion(messages=ASK, max_tokens=16, temperature=0)
    same = client.chat.completions.create(model="m", messages=ASK, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in hf.chat_completion(
        messages=ASK, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == same.choices[0].message.content


def test_unimplemented_fields_are_refused_by_name_or_with_lenient_params_a_warning(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=2, extra_body={"frobnicate": 1,
                                                                                           "guided_whitespace": "x"})
    assert "`frobnicate`" in e.value.message and "`guided_whitespace`" in e.value.message
    lenient = RouterProcess(["--simulate", "sm_80", "--lenient-params"])
    try:
        r = httpx.post(f"{lenient.url}/v1/chat/completions", timeout=30,
                       json={"model": "m", "messages": ASK, "max_tokens": 2, "frobnicate": 1})
        assert r.status_code == 200 and "`frobnicate`" in r.headers["warning"]
        assert r.headers["warning"].startswith("299 hetserve ")
    finally:
        lenient.stop()
