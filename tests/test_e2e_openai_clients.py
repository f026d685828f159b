"""The OpenAI surface with real clients against a real `hetserve serve` on the embedded model:
the `openai` client for logprobs, prompt scoring, JSON mode, JSON schema, tools and the
sampling fields (every structured output parsed and validated with `jsonschema`), and
`huggingface_hub`'s client for TGI's grammar, top tokens and prompt details."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

from tests.router_harness import running_router
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "wise"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--dtype", "float32", "--max-batch", "8"], fake=False, ready_timeout=240)


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_logprobs_streamed_and_not(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Tell me a fortune"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert (entry.top_logprobs[0].token == entry.token
                and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob))
        assert bytes(entry.bytes).decode(errors="replace") == entry.token or entry.token.startswith("bytes:")
    stream = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def test_completion_logprobs_and_prompt_scoring(client, router):
    r = client.completions.create(model="m", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) >= 2 for t in lp.top_logprobs)  # 2 alternatives + the chosen one
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    # echo + max_tokens 0: the prompt's tokens and logprobs only, the first one null
    ids = [1, 3042, 1294, 263, 609]  # "<|bos|>Once upon a time"
    s = client.completions.create(model="m", prompt=[ids], echo=True, max_tokens=0, logprobs=1)
    lp = s.choices[0].logprobs
    assert s.choices[0].text == "Once upon a time" and s.usage.completion_tokens == 0
    assert lp.tokens == ["<|bos|>", "Once", " upon", " a", " time"] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    # the same scores through TGI's decoder_input_details, and with one generated token (lm-eval's request)
    tgi = router.client().post("/generate", json={"inputs": "Once upon a time", "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True}}).json()["details"]["prefill"]
    assert [p["logprob"] for p in tgi[1:]] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    one = client.completions.create(model="m", prompt="Once upon a time", echo=True, max_tokens=1, logprobs=1,
                                    temperature=0)
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    assert one.choices[0].logprobs.token_logprobs[1:-1] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    streamed = list(client.completions.create(model="m", prompt=[ids], echo=True, max_tokens=0, logprobs=1,
                                              stream=True))
    assert streamed[0].choices[0].text == "Once upon a time" and streamed[0].choices[0].logprobs.tokens == lp.tokens


def test_json_schema_outputs_always_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe someone."}],
                                       response_format=fmt, max_tokens=60, n=3, seed=11, temperature=1.0)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "And another."}],
                                            response_format=fmt, max_tokens=60, stream=True, temperature=0)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON)


def test_parse_with_a_pydantic_model_and_json_mode(client):
    class Fortune(BaseModel):
        lucky_number: int = Field(ge=1, le=99)
        omen: str = Field(max_length=20)

    parsed = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "My fortune?"}],
                                           response_format=Fortune, max_tokens=40, temperature=0)
    fortune = parsed.choices[0].message.parsed
    assert isinstance(fortune, Fortune) and 1 <= fortune.lucky_number <= 99
    # JSON mode: any object. The tiny model's strings run on for hundreds of tokens, so a bias on
    # `}` (id 98) lets its object close; the same request without JSON mode is not JSON at all.
    kw = dict(model="m", messages=[{"role": "user", "content": "JSON please"}], max_tokens=40, temperature=0,
              logit_bias={"98": 6})
    r = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(ValueError):
        json.loads(client.chat.completions.create(**kw).choices[0].message.content)


def test_a_schema_the_engine_cannot_enforce_is_a_422_naming_why(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "zipcode"}}}
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="m", messages=ASK, response_format=bad, max_tokens=5)
    assert "Unknown format: zipcode" in str(e.value)


def _validate_calls(calls, tools=(WEATHER, CLOCK)):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_forced_tool_calls_always_parse_and_validate(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                       max_tokens=40, temperature=0)
    msg = r.choices[0].message
    assert (r.choices[0].finish_reason == "tool_calls" and msg.content is None
            and msg.tool_calls[0].function.name == "get_weather")
    _validate_calls(msg.tool_calls)
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, seed=5, temperature=0.8)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    _validate_calls(r.choices[0].message.tool_calls)
    # streamed: the deltas assemble into calls that validate
    for choice in (named, "required"):
        chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK],
                                                     tool_choice=choice, parallel_tool_calls=False, max_tokens=60,
                                                     temperature=0, stream=True))
        calls: dict[int, dict] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), {"get_weather": WEATHER, "get_time": CLOCK}[call["name"]]
                                ["function"]["parameters"])


def test_tool_choice_none_and_auto_and_a_tool_result_turn(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    turn = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    r = client.chat.completions.create(model="m", messages=turn, tools=[WEATHER], max_tokens=8)  # auto
    message = r.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:
        _validate_calls(message.tool_calls)


def test_sampling_surface(client, router):
    base = dict(model="m", messages=[{"role": "user", "content": "Tell me a fortune"}], max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**base).choices[0].message.content
    # stop: more than OpenAI's 4 strings, never in the returned text
    stops = [" is", " the", " a", ".", ",", "!"]
    r = client.chat.completions.create(**base, stop=stops)
    assert r.choices[0].finish_reason == "stop" and not any(s in r.choices[0].message.content for s in stops)
    assert plain.startswith(r.choices[0].message.content)
    # max_completion_tokens; logit_bias -100 on the greedy first token (its id from TGI's details) bans it
    first = client.chat.completions.create(**base, max_completion_tokens=1, logprobs=True).choices[0]
    assert first.finish_reason == "length" and len(first.logprobs.content) == 1
    greedy = router.client().post("/generate", json={"inputs": "Tell me a fortune", "parameters": {
        "max_new_tokens": 1, "details": True}}).json()["details"]["tokens"][0]
    kw = dict(model="m", prompt="Tell me a fortune", max_tokens=1, temperature=0, logprobs=0)
    assert client.completions.create(**kw).choices[0].text == greedy["text"]
    assert client.completions.create(**kw, logit_bias={str(greedy["id"]): -100}).choices[0].text != greedy["text"]
    # penalties (on output tokens) change a greedy answer that repeats " the"
    kw = dict(model="m", prompt="The", max_tokens=30, temperature=0)
    repeats = client.completions.create(**kw).choices[0].text
    assert repeats.count(" the") >= 1
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}):
        assert client.completions.create(**kw, **penalty).choices[0].text != repeats
    # seed: the same draws; user: accepted
    sampled = dict(base, temperature=1.0, seed=42, user="alice")
    assert client.chat.completions.create(**sampled).choices[0].message.content == \
        client.chat.completions.create(**sampled).choices[0].message.content


def test_n_and_batched_prompts_stream_per_index(client):
    chunks = list(client.completions.create(model="m", prompt=["Love is", "Money is"], n=2, max_tokens=5, seed=1,
                                            stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finished = set()
    for c in chunks[:-1]:
        ch = c.choices[0]
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        if ch.finish_reason:
            finished.add(ch.index)
    assert finished == {0, 1, 2, 3} and chunks[-1].usage.completion_tokens == 20
    whole = client.completions.create(model="m", prompt=["Love is", "Money is"], n=2, max_tokens=5, seed=1)
    assert {c.index: c.text for c in whole.choices} == texts  # seed + k per choice, streamed or not


def test_unsupported_fields_are_still_422_naming_them(client):
    with pytest.raises(openai.UnprocessableEntityError, match="`suffix`"):
        client.completions.create(model="m", prompt="x", suffix="y")
    with pytest.raises(openai.UnprocessableEntityError, match="`best_of`"):
        client.completions.create(model="m", prompt="x", best_of=2)


def test_tgi_grammar_top_tokens_and_prompt_details_with_huggingface_hub(router):
    tgi = InferenceClient(router.url)
    out = tgi.text_generation("Describe someone.", max_new_tokens=60, details=True, decoder_input_details=True,
                              top_n_tokens=2, grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(out.generated_text), PERSON)
    assert out.details.prefill[0].logprob is None and all(p.logprob <= 0 for p in out.details.prefill[1:])
    assert len(out.details.top_tokens) == len(out.details.tokens) and all(len(t) == 2 for t in out.details.top_tokens)
    text = tgi.text_generation("Answer:", max_new_tokens=20, grammar={"type": "regex", "value": "(yes|no)!"})
    assert text in ("yes!", "no!")
