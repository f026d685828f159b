"""Tool-call reading (server/protocol/tool_parsers/) against output a client can make hostile:
nested ten thousand deep, and streamed in thousands of pieces.

Deep output reached `json.loads`, which recursed until a `RecursionError` escaped the splitter
(a stream cut without an end, a 422 that blamed the request); now it is content, never an
error. Long regions were re-read whole at every piece, on the router's event loop; the cost of
reading N and 4N pieces is counted here (Python lines run in the package, characters the scans
step over), never timed: linear reading costs about 4 times as much, a re-reading about 16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.tool_call_stream import CASES
from server.protocol.anthropic.messages import message_object
from server.protocol.harmony import gather
from server.protocol.openai.tools import NAMED, ToolPlan
from server.protocol.tool_parsers import jsonscan
from server.protocol.tool_parsers.jsonscan import loads, too_deep
from server.protocol.tool_parsers.splitter import ToolAnswer, ToolCallSplitter, split_tool_calls
from server.protocol.tool_parsers.syntax import GENERIC, HERMES, MISTRAL, PYTHONIC, REQUIRED

NAMES = ("get_weather", "get_time")
DEEP = "[" * 10_000 + "]" * 10_000
PACKAGE = str(Path(jsonscan.__file__).parent)

# (format, an answer holding DEEP where a call's arguments, or the whole answer, would be)
DEEP_ANSWERS = [
    (GENERIC, '{"name": "get_weather", "arguments": {"a": %s}}'),  # `_call_object`, then `json_object`
    (GENERIC, '{"arguments": {"a": %s}, "name": "get_weather"}'),  # `_whole_object`
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": "{\\"a\\": %s}"}</tool_call>'),  # arguments as text
    (REQUIRED, '[{"name": "get_weather", "arguments": {"a": %s}}]'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"a": %s}'),
    (PYTHONIC, "[get_weather(a=%s)]"),
    (GENERIC, "%s"),
]


@pytest.mark.parametrize(("syntax", "template"), DEEP_ANSWERS)
def test_a_whole_answer_nested_ten_thousand_deep_is_content(syntax, template):
    """Guards `loads`' depth bound in `json_object`, `_whole_object` and `_string_object`
    (region.py): without it `json.loads` raised a `RecursionError` out of `split_tool_calls`."""
    text = template % DEEP
    assert split_tool_calls(syntax, NAMES, text) == ToolAnswer(text, ())


@pytest.mark.parametrize(("syntax", "template"), DEEP_ANSWERS)
def test_a_streamed_answer_nested_ten_thousand_deep_ends_without_an_error(syntax, template):
    """The same output in pieces of 7 characters: every piece and the end are read; a call begun
    keeps the text it streamed (a stream cannot take it back) and is marked invalid."""
    text = template % DEEP
    splitter = ToolCallSplitter(syntax, NAMES)
    parts = [p for at in range(0, len(text), 7) for p in splitter.feed(text[at:at + 7])] + splitter.finish()
    answer = gather(parts)
    assert not (splitter.calls and splitter.valid)
    assert DEEP in (answer.content or "") + "".join(a for _, a in answer.calls)  # nothing lost


def test_a_named_call_and_anthropic_tool_input_nested_ten_thousand_deep_are_not_calls():
    """Guards `loads` in `ToolPlan.calls` (openai/tools.py) and Anthropic's `_input`."""
    arguments = '{"a": ' + DEEP + "}"
    assert ToolPlan(NAMED, ({"name": "get_weather"},), "get_weather").calls(arguments) is None
    call = {"id": "call_1", "function": {"name": "get_weather", "arguments": arguments}}
    choice = {"message": {"tool_calls": [call]}}
    assert message_object("msg_1", "m", choice, {}, None)["content"] == [{"type": "text", "text": arguments}]


def test_loads_bounds_nesting_and_counts_no_bracket_inside_a_string():
    with pytest.raises(ValueError, match="nests deeper than 64 levels"):
        loads(DEEP)
    assert loads("[" * 64 + "]" * 64) == json.loads("[" * 64 + "]" * 64)
    quoted = json.dumps({"a": "[{" * 10_000})
    assert not too_deep(quoted) and loads(quoted) == {"a": "[{" * 10_000}
    assert too_deep('{"a": "\\"", "b": ' + "[" * 65 + "]" * 65 + "}")  # an escaped quote ends no string


def _lines_run(pieces: list[str]) -> int:
    """Python lines run inside server/protocol/tool_parsers/ while `pieces` are read."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    splitter = ToolCallSplitter(REQUIRED, NAMES)
    sys.settrace(calls)
    try:
        for piece in pieces:
            splitter.feed(piece)
        splitter.finish()
    finally:
        sys.settrace(None)
    assert splitter.valid and splitter.calls
    return count


@pytest.mark.parametrize("case", sorted(CASES))
def test_reading_four_times_the_pieces_runs_about_four_times_the_lines(case):
    """Guards the region's memo (`RegionMemo`, `Scans`): re-reading the region from its start at
    every piece ran 16 times the lines for 4 times the pieces."""
    small, large = _lines_run(CASES[case](250)), _lines_run(CASES[case](1000))
    assert large / small < 6, (small, large)


class _Counting:
    """A compiled pattern that adds the characters each match steps over to `total`."""

    total = 0

    def __init__(self, pattern):
        self.pattern = pattern

    def match(self, text: str, pos: int = 0):
        m = self.pattern.match(text, pos)
        _Counting.total += m.end() - pos
        return m


def _characters_scanned(pieces: list[str]) -> int:
    _Counting.total = 0
    splitter = ToolCallSplitter(REQUIRED, NAMES)
    for piece in pieces:
        splitter.feed(piece)
    splitter.finish()
    return _Counting.total


@pytest.mark.parametrize("case", sorted(CASES))
def test_reading_four_times_the_pieces_scans_about_four_times_the_characters(case, monkeypatch):
    """Guards the scans resuming where they stopped (`Scans.value_end`, `Scans.skip_ws`): the runs
    of characters that change no state are skipped in C, where a re-reading costs no Python line."""
    for name in ("_WS_RUN", "_SCALAR_RUN"):
        monkeypatch.setattr(jsonscan, name, _Counting(getattr(jsonscan, name)))
    monkeypatch.setattr(jsonscan.JSON, "plain", _Counting(jsonscan.JSON.plain))
    monkeypatch.setitem(jsonscan.JSON.body, '"', _Counting(jsonscan.JSON.body['"']))
    small, large = _characters_scanned(CASES[case](1000)), _characters_scanned(CASES[case](4000))
    text = "".join(CASES[case](4000))
    assert large / small < 6 and large < 2 * len(text), (small, large, len(text))
