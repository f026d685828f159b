"""The router's OpenAI layer as pure functions: request validation, the worker parameters it
sends, logprob shapes, tool-call planning and parsing, and streamed choices."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.protocol.openai import responses as fmt
from server.protocol.openai.choices import ChoiceSpec, ChoiceStream, chat_choice, completion_choice
from server.protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from server.protocol.openai.tools import (
    AUTO,
    NAMED,
    ToolPlan,
    plan_tools,
    required_schema,
    template_messages,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=kw.pop("messages", USER), **kw)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: chat(top_logprobs=2), "`top_logprobs` needs `logprobs` = true"),
        (lambda: chat(top_logprobs=21, logprobs=True), "top_logprobs"),
        (lambda: chat(tool_choice="required"), "`tool_choice` = `required` needs `tools`"),
        (lambda: chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "names function `nope`, which is not in `tools`. Accepted: get_weather"),
        (lambda: chat(tools=[WEATHER, WEATHER]), "`tools` names must be unique"),
        (lambda: chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "both constrain the output"),
        (lambda: chat(response_format={"type": "json_schema"}), "`response_format.json_schema` is required"),
        (lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
         "must be a JSON schema (an object)"),
        (lambda: chat(response_format={"type": "xml"}), "response_format.type"),
        (lambda: chat(logit_bias={"abc": 1}), "`logit_bias` keys must be token ids"),
        (lambda: chat(logit_bias={"5": 101}), "`logit_bias` values must be in [-100, 100]"),
        (lambda: CompletionRequest(prompt="x", max_tokens=0), "`max_tokens` = 0 scores the prompt only"),
        (lambda: CompletionRequest(prompt="x", logprobs=21), "logprobs"),
        (lambda: CompletionRequest(prompt=[[1, 2], [-1]]), "prompt"),
        (lambda: CompletionRequest(prompt="x", stop=["s"] * 17), "at most 16"),
    ],
)
def test_bad_requests_name_the_field(make, needle):
    with pytest.raises(ValidationError) as e:
        make()
    assert needle in str(e.value)


def test_openai_fields_become_worker_parameters():
    p = chat(stop="\n", presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": 3}, temperature=0).sampling(8)
    assert p.stop == ("\n",) and p.include_stop_str_in_output is False  # OpenAI: stop not in the text
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, {7: 3.0})
    assert CompletionRequest(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]], n=2).prompts == [[1], [2, 3]]
    assert chat(logprobs=True).top_n == 0 and chat(logprobs=True, top_logprobs=3).top_n == 3 and chat().top_n is None


def test_token_strings_follow_openais_bytes_convention():
    assert fmt.token_str([32, 104, 105]) == " hi"
    assert fmt.token_str([0xE2, 0x82]) == "bytes:\\xe2\\x82"  # half of "€"
    assert fmt.token_str(None, "fallback") == "fallback"


def test_completion_logprobs_columns_offsets_and_alternatives():
    tokens = [{"text": "<s>", "logprob": None, "special": True, "bytes": list(b"<s>")},
              {"text": "Hi", "logprob": -1.0, "bytes": list(b"Hi")},
              {"text": " there", "logprob": -2.0, "bytes": list(b" there")}]
    tops = [None, [{"text": "Yo", "logprob": -0.5, "bytes": list(b"Yo")}], []]
    lp = fmt.completion_logprobs(tokens, tops)
    assert lp["tokens"] == ["<s>", "Hi", " there"] and lp["token_logprobs"] == [None, -1.0, -2.0]
    assert lp["text_offset"] == [0, 0, 2]  # a special token is not in the text
    assert lp["top_logprobs"] == [None, {"Yo": -0.5, "Hi": -1.0}, {" there": -2.0}]  # the chosen token is included


def test_tool_plans_and_their_grammars():
    assert plan_tools(chat()).mode == "none"
    assert plan_tools(chat(tools=[WEATHER])).mode == AUTO
    named = plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.mode == NAMED and named.grammar()["value"] == WEATHER["function"]["parameters"]
    assert named.calls('{"city": "Paris"}') == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert named.calls('{"city": "Par') is None  # cut short by max_tokens: content, not a call
    required = plan_tools(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    schema = required.grammar()["value"]
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert required.calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]') == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_required_schema_hoists_defs_so_refs_resolve():
    f = {"name": "f", "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                                     "$defs": {"P": {"type": "integer"}}}}
    schema = required_schema((f,), parallel=True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]
    other = {"name": "g", "parameters": {"type": "object", "$defs": {"P": {"type": "string"}}}}
    with pytest.raises(ValueError, match="define `\\$defs/P` twice"):
        required_schema((f, other), parallel=True)


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
         [("get_weather", {"city": "Rome"})]),
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [("get_weather", {"city": "Rome"})]),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {}}]',
         [("get_weather", {"city": "A"}), ("get_weather", {})]),
        ('{"name": "unknown", "arguments": {}}', None),
        ("It is sunny.", None),
        ('{"name": "get_weather", "arguments": "not json"}', None),
    ],
)
def test_auto_tool_calls_in_common_formats(text, calls):
    got = ToolPlan(AUTO, (WEATHER["function"],)).calls(text)  # the generic reader (no format named)
    assert (None if got is None else [(c["name"], json.loads(c["arguments"])) for c in got]) == calls


def test_templates_without_tools_get_them_as_a_system_message():
    req = chat(tools=[WEATHER], messages=[
        *USER,
        {"role": "assistant",
         "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    plain = template_messages(req, native_tools=False)
    assert plain[0]["role"] == "system" and "get_weather" in plain[0]["content"]
    assert json.loads(plain[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    native = template_messages(req, native_tools=True)
    assert native[0] == USER[0] and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


# -- choices from worker answers -------------------------------------------------------------------


def tok(text: str, logprob: float = -1.0, special: bool = False) -> dict:
    return {"id": 9, "text": text, "logprob": logprob, "special": special, "bytes": list(text.encode())}


def test_whole_choices_parse_tool_calls_and_echo_token_prompts():
    body = {"generated_text": '{"city": "Paris"}', "details": {"finish_reason": "eos_token", "tokens": []}}
    plan = ToolPlan(NAMED, (WEATHER["function"],), "get_weather")
    c = chat_choice(ChoiceSpec(0, tools=plan), body)
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    assert c["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    cut = chat_choice(ChoiceSpec(0, tools=plan), {**body, "details": {"finish_reason": "length"}})
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == '{"city": "Paris"}'
    scored = {"generated_text": "", "input_text": "Hi there", "details": {
        "finish_reason": "length", "tokens": [], "prefill": [tok("Hi", None), tok(" there", -3.0)]}}
    c = completion_choice(ChoiceSpec(0, top=0, echo=True), scored)
    assert c["text"] == "Hi there" and c["logprobs"]["token_logprobs"] == [None, -3.0]


def test_streamed_chat_logprob_entries_are_never_lost():
    """A token with no text yet (a held-back half character, EOS) keeps its entry: it rides on
    the next delta (guards `ChoiceStream._pending`)."""
    s = ChoiceStream(ChoiceSpec(0, top=0), chat=True)
    events = [{"token": tok("Hel")}, {"token": {**tok(""), "bytes": [0xE2]}}, {"token": tok("lo€")},
              {"token": tok("<eos>", special=True), "details": {"finish_reason": "eos_token", "generated_tokens": 4,
                                                                "input_length": 3}}]
    deltas = [d for e in events for d in s.on_event(e)]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hello€"
    entries = [x for d in deltas if d["logprobs"] for x in d["logprobs"]["content"]]
    assert [x["token"] for x in entries] == ["Hel", "bytes:\\xe2", "lo€", "<eos>"]
    assert deltas[-1]["finish_reason"] == "stop" and (s.prompt_tokens, s.completion_tokens) == (3, 4)


def test_streamed_auto_tool_call_goes_out_by_name_then_arguments_and_plain_text_is_not_held():
    plan = ToolPlan(AUTO, (WEATHER["function"],))
    s = ChoiceStream(ChoiceSpec(0, tools=plan), chat=True)
    pieces = ['{"name": "get_', 'weather", "arguments": ', '{"city": ', '"Paris"}}']
    deltas = [[d["delta"] for d in s.on_event({"token": tok(p)})] for p in pieces]
    assert deltas[0] == [{"role": "assistant", "content": ""}]  # the name is not known yet
    (start,) = deltas[1][0]["tool_calls"]
    assert start["index"] == 0 and start["id"].startswith("call_") and start["function"] == {
        "name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2] + deltas[3]] == ['{"city": ', '"Paris"}']
    end = s.on_event({"token": tok("", special=True), "details": {"finish_reason": "eos_token"}})
    assert [d["finish_reason"] for d in end] == ["tool_calls"]
    talk = ChoiceStream(ChoiceSpec(0, tools=plan), chat=True)
    assert [d["delta"] for d in talk.on_event({"token": tok("Sunny")})][-1] == {"content": "Sunny"}


def test_streamed_completion_echo_comes_first_with_the_prompts_logprobs():
    s = ChoiceStream(ChoiceSpec(1, top=1, echo=True), chat=False)
    first = {"token": tok(" day"), "input_text": "Good", "prefill": [{**tok("Good", None), "top_tokens": []}],
             "top_tokens": [tok(" day")]}
    deltas = s.on_event(first)
    assert [d["text"] for d in deltas] == ["Good", " day"] and all(d["index"] == 1 for d in deltas)
    assert deltas[0]["logprobs"]["tokens"] == ["Good"] and deltas[1]["logprobs"]["text_offset"] == [4]


def test_chunk_frames_equal_the_chunks_serialized_whole():
    """Guards `ChunkFrames.__call__`: a frame built from the head serialized once is byte for byte
    what `fmt.sse(chunk(...))` gives, for completions and chat, odd text included."""
    from server.edge.routes.openai import ChunkFrames
    from server.protocol.openai import responses as fmt

    for chunk in (fmt.completion_chunk, fmt.chat_chunk):
        frames = ChunkFrames(chunk, "cmpl-1", 1764547200, 'model "x"/é')
        for choice in ({"index": 0, "text": ' a\n"b"\u2028', "finish_reason": None, "logprobs": None},
                       {"index": 1, "delta": {"content": "é"}, "finish_reason": "stop", "logprobs": None}):
            assert frames(choice) == fmt.sse(chunk("cmpl-1", 1764547200, 'model "x"/é', choice))
