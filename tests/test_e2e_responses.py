"""OpenAI's Responses API end to end: the real `openai` client's `client.responses.create`,
`client.responses.stream` and `client.responses.retrieve` against a real `hetserve serve` on
the embedded model.

Each answer is checked against the chat completion of the same conversation (greedy, so the
same text and token counts: Responses is a translation onto the chat pipeline), the streamed
events against OpenAI's order and the final response, function calls against their schema and
fed back both through `previous_response_id` and as the whole conversation, and bad input
against OpenAI's error shape.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.router_harness import running_router
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

ASK = "Tell me a fortune"  # greedy: `You know a fortune cookie.` (7 tokens, then EOS)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The forecast for a city.", "parameters": CITY}


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--dtype", "float32", "--max-batch", "8"], fake=False, ready_timeout=240)


@pytest.fixture(scope="module")
def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_answer_of_the_same_conversation(client):
    r = client.responses.create(model="m", input=ASK, max_output_tokens=64, temperature=0)
    chat = _chat(client, [{"role": "user", "content": ASK}], max_tokens=64)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    (item,) = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                          "output_text")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # `instructions` is the system message; items in `input` are the messages
    given = client.responses.create(model="m", instructions="Be brief.", max_output_tokens=64, temperature=0,
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=64)
    assert (given.output_text, given.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)
    assert given.usage.input_tokens > r.usage.input_tokens and given.instructions == "Be brief."


def test_max_output_tokens_cuts_the_response_as_incomplete(client):
    r = client.responses.create(model="m", input=ASK, max_output_tokens=3, temperature=0)
    assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert r.output[0].status == "incomplete" and r.max_output_tokens == 3


def test_a_streamed_response_sends_openais_events_in_order_and_ends_with_the_whole_response(client):
    whole = client.responses.create(model="m", input=ASK, max_output_tokens=64, temperature=0)
    with client.responses.stream(model="m", input=ASK, max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.id == final.output[0].id and final.id == events[0].response.id
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                      whole.usage.output_tokens)
    cut = list(client.responses.create(model="m", input=ASK, max_output_tokens=3, temperature=0, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.usage.output_tokens == 3
    stored = client.responses.retrieve(final.id)  # a streamed response is stored as it ended
    assert (stored.output_text, stored.output[0].id) == (final.output_text, final.output[0].id)


def test_previous_response_id_continues_a_stored_response_and_store_false_keeps_nothing(client):
    first = client.responses.create(model="m", input=ASK, max_output_tokens=64, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(model="m", previous_response_id=first.id, input="Another one",
                                     max_output_tokens=16, temperature=0)
    chat = _chat(client, [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Another one"}], max_tokens=16)
    assert (follow.output_text, follow.usage.input_tokens) == (chat.choices[0].message.content,
                                                                chat.usage.prompt_tokens)
    assert follow.previous_response_id == first.id
    unstored = client.responses.create(model="m", input=ASK, max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_never_made"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.retrieve(missing)
        assert f"`{missing}`" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", previous_response_id=unstored.id, input="x", max_output_tokens=2)
    assert f"`{unstored.id}`" in e.value.message and "store" in e.value.message


def test_a_json_schema_text_format_gives_a_valid_document(client):
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "age": {"type": "integer",
                                                                                          "minimum": 0,
                                                                                          "maximum": 99}},
              "required": ["mood", "age"], "additionalProperties": False}
    r = client.responses.create(model="m", input="Describe yourself", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "me", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_function_calls_streamed_and_not_and_their_outputs_fed_back(client):
    kw = dict(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    r = client.responses.create(**kw)
    (call,) = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments == final.output[0].arguments == call.arguments and len(deltas) > 1
    # the output fed back: through the stored response, or with the whole conversation as items
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    after = client.responses.create(model="m", previous_response_id=r.id, input=[result], tools=[WEATHER],
                                    max_output_tokens=8, temperature=0)
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             result]
    whole = client.responses.create(model="m", input=items, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert (after.output_text, after.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    without = client.responses.create(model="m", input=items[:2], tools=[WEATHER], max_output_tokens=1)
    assert whole.usage.input_tokens > without.usage.input_tokens  # the output reached the prompt
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output] == ["get_weather"]


def test_bad_input_is_a_4xx_in_openais_error_shape_naming_the_value(client, router):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=ASK, max_output_tokens=2, extra_body={"frobnicate": 1})
    assert "`frobnicate`" in e.value.message  # an unimplemented field is refused, not ignored
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.responses.create(model="m", input=ASK, max_output_tokens=2, reasoning={"effort": "extreme"})
    assert "`extreme`" in e.value.message and "low, medium, high" in e.value.message
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.responses.create(model="m", input=ASK, max_output_tokens=10**6)
    assert "`max_output_tokens`" in e.value.message
    with httpx.Client(base_url=router.url, timeout=30) as http:
        for body in ({"model": "m", "input": 5}, {"model": "m", "input": [{"type": "bogus"}]}, {"model": "m"}):
            reply = http.post("/v1/responses", json=body)
            assert reply.status_code == 422, body
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error" and "`input" in error["message"], body
