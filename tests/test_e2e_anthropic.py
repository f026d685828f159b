"""Anthropic's Messages API end to end: the real `anthropic` client (`messages.create`,
`messages.stream`, `messages.count_tokens`) against a real `hetserve serve --api-key` on the
embedded model, the key sent as Anthropic's clients send it (`x-api-key`).

Each message is checked against the chat completion of the same conversation (greedy: the
same text and token counts, since Messages is a translation onto the chat pipeline), the stream
against Anthropic's event names and the final message, tool use against its schema and fed
back as `tool_result`, `count_tokens` against the usage of the message, and bad input against
Anthropic's error shape.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.router_harness import RouterProcess
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

KEY = "sk-test-33"
ASK = [{"role": "user", "content": "Tell me a fortune"}]  # greedy: `You know a fortune cookie.`
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
# this client has no sampling arguments (2.x): the server still takes `temperature` as older clients send it
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The forecast for a city.", "input_schema": CITY}


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--dtype", "float32", "--max-batch", "8", "--api-key", KEY], fake=False, ready_timeout=240)
    yield r
    r.stop()
    assert not r.orphans


@pytest.fixture(scope="module")
def client(router) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_message_is_the_chat_answer_of_the_same_conversation(client, chat):
    m = client.messages.create(model="m", max_tokens=64, messages=ASK, system="Be brief.", **GREEDY)
    c = chat.chat.completions.create(model="m", messages=[{"role": "system", "content": "Be brief."}, *ASK],
                                     max_tokens=64, temperature=0)
    assert (m.type, m.role, m.stop_reason, m.stop_sequence) == ("message", "assistant", "end_turn", None)
    assert _text(m) == c.choices[0].message.content and _text(m)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert m.id.startswith("msg_")
    # content blocks and a system given as blocks: the same prompt
    blocks = client.messages.create(model="m", max_tokens=64, **GREEDY, system=[{"type": "text",
                                                                                      "text": "Be brief."}],
                                    messages=[{"role": "user",
                                               "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert (_text(blocks), blocks.usage.input_tokens) == (_text(m), m.usage.input_tokens)
    counted = client.messages.count_tokens(model="m", messages=ASK, system="Be brief.")
    assert counted.input_tokens == m.usage.input_tokens


def test_max_tokens_and_stop_sequences_end_a_message_with_their_stop_reason(client):
    cut = client.messages.create(model="m", max_tokens=3, messages=ASK, **GREEDY)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)
    whole = _text(client.messages.create(model="m", max_tokens=64, messages=ASK, **GREEDY))
    stopped = client.messages.create(model="m", max_tokens=64, messages=ASK, **GREEDY, stop_sequences=["fortune"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "fortune")
    assert _text(stopped) == whole[:whole.index("fortune")]


def test_a_streamed_message_sends_anthropics_events_and_ends_with_the_whole_message(client):
    """Guards `writer.start(counted.get("count", 0))` in server/edge/routes/anthropic.py: the
    prompt's tokens in `message_start` (0 before, as the worker reports them only at the end)."""
    whole = client.messages.create(model="m", max_tokens=64, messages=ASK, **GREEDY)
    with client.messages.stream(model="m", max_tokens=64, messages=ASK, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "input_json")]  # the client's own helper events
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == _text(final) == _text(whole)
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", whole.usage.output_tokens)
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    with client.messages.stream(model="m", max_tokens=2, messages=ASK, **GREEDY) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


def test_tool_use_streamed_and_not_and_its_result_fed_back(client):
    kw = dict(model="m", max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    m = client.messages.create(**kw)
    (use,) = m.content
    assert (use.type, use.name, m.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(partial) > 1 and final.content[0].input == use.input and final.stop_reason == "tool_use"
    start = next(e for e in events if e.type == "content_block_start")
    assert (start.content_block.type, start.content_block.name) == ("tool_use", "get_weather")
    any_tool = client.messages.create(**{**kw, "tool_choice": {"type": "any"}})
    assert [b.type for b in any_tool.content] == ["tool_use"]
    turns = [*kw["messages"],
             {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]}]
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}
    fed = client.messages.count_tokens(model="m", messages=[*turns, result], tools=[WEATHER])
    bare = client.messages.count_tokens(model="m", messages=[*turns, {"role": "user", "content": "ok"}],
                                        tools=[WEATHER])
    assert fed.input_tokens > bare.input_tokens  # the result reached the prompt
    answer = client.messages.create(model="m", max_tokens=4, messages=[*turns, result], tools=[WEATHER])
    assert answer.usage.input_tokens == fed.input_tokens


def test_output_config_constrains_the_text_and_cache_control_is_taken_as_claude_code_sends_it(client):
    """Guards `output_config` and `cache_control` in server/protocol/anthropic/requests.py: the
    2026 client's structured output and prompt-caching hints, refused as unknown fields before."""
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
              "additionalProperties": False}
    cached = {"type": "ephemeral"}
    m = client.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": [
        {"type": "text", "text": "How are you?", "cache_control": cached}]}], cache_control=cached,
        system=[{"type": "text", "text": "Answer in JSON.", "cache_control": cached}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    jsonschema.validate(json.loads(_text(m)), schema)
    assert m.stop_reason == "end_turn"
    with pytest.raises(anthropic.UnprocessableEntityError) as e:
        client.messages.create(model="m", max_tokens=2, messages=ASK, output_config={"effort": "max"})
    assert "`output_config.effort`" in e.value.message and "'low', 'medium' or 'high'" in e.value.message


def test_the_key_is_checked_and_errors_come_in_anthropics_shape(client, router):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=2, messages=ASK, extra_body={"frobnicate": 1})
    assert "`frobnicate`" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=router.url, timeout=30, headers={"x-api-key": KEY}) as http:
        for body, needle in (({"model": "m", "messages": ASK}, "`max_tokens` is required"),
                             ({"model": "m", "max_tokens": 0, "messages": ASK}, "`max_tokens`"),
                             ({"model": "m", "max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]},
                              "`messages.0.role`"),
                             ({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
                                 {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
                              "`image` blocks are not supported")):
            reply = http.post("/v1/messages", json=body)
            assert 400 <= reply.status_code < 500, body
            error = reply.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            assert needle in error["error"]["message"], error
