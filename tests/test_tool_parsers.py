"""Tool calls in each family's own format (server/protocol/tool_parsers/): whole answers, every
split of a stream, incremental argument deltas, text that is not a call, and the choice of
format from the chat template or `--tool-call-parser`."""

from __future__ import annotations

import json

import pytest

from server.protocol.harmony import ARGUMENTS, CONTENT, TOOL_CALL, gather, output_text
from server.protocol.tool_parsers.choose import choose_tool_parser
from server.protocol.tool_parsers.jsonscan import INCOMPLETE, MALFORMED, value_end
from server.protocol.tool_parsers.splitter import ToolCallSplitter, split_tool_calls
from server.protocol.tool_parsers.syntax import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    REQUIRED,
)

NAMES = ("get_weather", "get_time")
PARIS = ("get_weather", {"city": "Paris"})
NOW = ("get_time", {})

# (format, the model's text, the content, the calls as (name, arguments object))
WELL_FORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.", [PARIS, NOW]),
    (HERMES, '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>', None, [PARIS]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None,
     [PARIS]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),  # EOS before the tag
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                  '{"name": "get_time", "parameters": {}}', None, [PARIS, NOW]),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]', None, [PARIS, NOW]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None, [PARIS, NOW]),
    # the tag left out as special
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    (PYTHONIC, '[get_weather(city="Paris"), get_time()]', None, [PARIS, NOW]),
    (PYTHONIC, '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
    (GENERIC, '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
    (GENERIC, 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Sure.", [NOW]),
    (REQUIRED, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     None, [PARIS, NOW]),
]

# (format, text that is no call: it all comes back as content)
NOT_CALLS = [
    (HERMES, "It is sunny in Paris."),
    (HERMES, '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>'),  # not a listed tool
    (HERMES, "<tool_call>not json</tool_call> and more"),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut by the length limit
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city" "Paris"}}</tool_call>'),  # malformed
    (LLAMA3_JSON, '{"a": 1} is a JSON object'),
    (LLAMA3_JSON, 'The call would be {"name": "get_weather", "parameters": {}}'),  # not the answer itself
    (GENERIC, '{"name": "get_weather", "arguments": "not json"}'),
    (GENERIC, "[1, 2, 3] are numbers"),
    (MISTRAL, "[TOOL_CALLS]nope[ARGS]{}"),
    (PYTHONIC, "[1, 2] are numbers"),
    (PYTHONIC, '[get_weather(city=open("/etc/passwd").read())]'),  # not a literal: never evaluated
    (PYTHONIC, '[__import__("os").system("ls")]'),
]


def streamed(syntax, text: str, cuts) -> tuple[list, ToolCallSplitter]:
    """The parts of `text` fed in the pieces that `cuts` (positions) make."""
    s = ToolCallSplitter(syntax, NAMES)
    bounds = [0, *cuts, len(text)]
    parts = [p for a, b in zip(bounds, bounds[1:], strict=False) for p in s.feed(text[a:b])]
    return parts + s.finish(), s


def calls_of(answer) -> list:
    return [(n, json.loads(a)) for n, a in answer.calls]


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), WELL_FORMED)
def test_whole_answers_in_each_format(syntax, text, content, calls):
    answer = split_tool_calls(syntax, NAMES, text)
    assert (answer.content, calls_of(answer)) == (content, calls)


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), WELL_FORMED)
def test_every_two_piece_stream_gives_the_whole_answer(syntax, text, content, calls):
    """Guards the splitter's hold-back: a marker or a name cut anywhere is still read."""
    for cut in range(1, len(text)):
        parts, s = streamed(syntax, text, [cut])
        answer = gather(parts)
        assert s.valid and (answer.content, calls_of(answer)) == (content, calls), cut
        starts = [i for i, p in enumerate(parts) if p.kind == TOOL_CALL]
        for k, at in enumerate(starts):  # a call's name goes out before any of its arguments
            assert all(i > at for i, p in enumerate(parts) if p.kind == ARGUMENTS and p.call == k)


@pytest.mark.parametrize(("syntax", "text"), NOT_CALLS)
def test_text_that_is_no_call_comes_back_as_content(syntax, text):
    answer = split_tool_calls(syntax, NAMES, text)
    assert answer.calls == () and answer.content == text


def test_arguments_stream_as_they_are_written_before_the_call_closes():
    s = ToolCallSplitter(HERMES, NAMES)
    assert s.feed('<tool_call>\n{"name": "get_wea') == []  # the name is not complete: nothing yet
    start = s.feed('ther", "arguments": ')
    assert [(p.kind, p.text, p.call) for p in start] == [(TOOL_CALL, "get_weather", 0)]
    assert [(p.kind, p.text) for p in s.feed('{"city": "Pa')] == [(ARGUMENTS, '{"city": "Pa')]
    assert [(p.kind, p.text) for p in s.feed('ris"}}\n</tool_call>')] == [(ARGUMENTS, 'ris"}')]
    assert s.finish() == [] and s.valid


def test_plain_text_is_released_at_once_and_only_a_possible_marker_waits():
    s = ToolCallSplitter(HERMES, NAMES)
    assert [(p.kind, p.text) for p in s.feed("Sunny <tool")] == [(CONTENT, "Sunny")]  # " <tool" may open a call
    assert [(p.kind, p.text) for p in s.feed("s are great")] == [(CONTENT, " <tools are great")]
    bare = ToolCallSplitter(LLAMA3_JSON, NAMES)
    assert bare.feed("  ") == []  # the answer may still begin with a call
    assert [p.text for p in bare.feed("Hi")] == ["  Hi"]


def test_a_stream_keeps_a_call_it_began_even_when_cut_off():
    """A stream cannot take back a call it sent; the whole answer of the same text is content."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    parts, s = streamed(HERMES, text, [40])
    answer = gather(parts)
    assert answer.calls == (("get_weather", '{"city": "Par'),) and not s.valid
    assert split_tool_calls(HERMES, NAMES, text).calls == ()


def test_format_markers_a_tokenizer_marks_special_are_read_from_the_token_events():
    tokens = [{"text": "[TOOL_CALLS]", "special": True}, {"text": '[{"name": "get_time", "arguments": {}}]'},
              {"text": "</s>", "special": True}]
    text = output_text(tokens, '[{"name": "get_time", "arguments": {}}]', MISTRAL.markers)
    assert text == '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    assert output_text([{"text": "Hi"}, {"text": "</s>", "special": True}], "Hi", MISTRAL.markers) == "Hi"


def test_value_end_finds_where_a_json_value_stops_in_a_prefix():
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('{"a": [1, {"b": "\\"}"}]}', 0) == 24
    assert value_end('{"a": [1, 2', 0) is INCOMPLETE
    assert value_end('{"a": 1]', 0) == MALFORMED
    assert value_end("12", 0) is INCOMPLETE and value_end("12", 0, final=True) == 2


# the opening of each family's tool-call instructions (what the real templates write)
QWEN3 = ('{%- if tools %}...<tools>...</tools>...<tool_call>\\n'
         '{"name": <function-name>, "arguments": <args-json-object>}')
LLAMA31 = '...Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}'
MISTRAL_T = "{%- if message.tool_calls %}[TOOL_CALLS][{%- for tool_call in message.tool_calls %}"
PYTHONIC_T = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"


@pytest.mark.parametrize(
    ("flag", "template", "model_type", "name"),
    [
        ("auto", QWEN3, "qwen3", "hermes"),
        ("auto", LLAMA31, "llama", "llama3_json"),
        ("auto", "<|python_tag|>", "llama", "llama3_json"),
        ("auto", MISTRAL_T, "mistral", "mistral"),
        ("auto", PYTHONIC_T, "llama", "pythonic"),
        ("auto", "<|start|>{{ m }}<|channel|>final", None, "openai"),
        ("auto", "{{ messages }}", "gpt_oss", "openai"),
        ("auto", "{{ messages }}", "llama", "generic"),
        ("pythonic", QWEN3, "qwen3", "pythonic"),
        ("none", QWEN3, "qwen3", "none"),
    ],
)
def test_the_format_comes_from_the_flag_else_the_chat_template(flag, template, model_type, name):
    assert choose_tool_parser(flag, template, model_type).name == name


def test_an_unknown_parser_flag_is_refused_with_the_accepted_names():
    with pytest.raises(ValueError, match="Unknown tool-call parser `xml`. Accepted: auto, hermes, llama3_json"):
        choose_tool_parser("xml", "", None)
