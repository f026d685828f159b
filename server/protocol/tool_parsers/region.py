"""One call region (the text after an opening marker) -> the calls it holds so far.

Design: `parse_region` is a pure function of the region's text: called again each time the text
grows, it returns the calls found so far (a call's arguments as far as they have been written)
and whether the region has ended, is still open, or turned out not to hold calls. The splitter
(`splitter.py`) diffs successive results into deltas, so what a stream sends and what a whole
answer holds come from the same reading. Trade-off: re-reading the region at every piece costs
time quadratic in the region's length; regions are single calls of a few hundred characters,
and text outside regions is read once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from server.protocol.tool_parsers.jsonscan import INCOMPLETE, MALFORMED, skip_ws, value_end
from server.protocol.tool_parsers.pythonic import parse_pythonic
from server.protocol.tool_parsers.syntax import ARGUMENT_KEYS, ScanCall, ToolSyntax

_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_FIRST_KEY = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"')
_NAMED = "[ARGS]"
_CALL_ID = "[CALL_ID]"
MAX_NAME_CHARS = 64  # a tool name is at most this long (OpenAI's limit): longer text is not a name


@dataclass(frozen=True)
class RegionScan:
    """What a region holds so far; `end` (where it stopped, in its text) once it has ended,
    `failed` (at `fail_at`) when it is not, or stopped being, a list of calls."""

    calls: tuple[ScanCall, ...]
    end: int | None = None
    failed: bool = False
    fail_at: int = 0


def json_object(text: str) -> bool:
    """The text parses as a JSON object (what a call's arguments must be)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _open(calls: list[ScanCall]) -> RegionScan:
    return RegionScan(tuple(calls))


def _fail(calls: list[ScanCall], at: int) -> RegionScan:
    return RegionScan(tuple(calls), failed=True, fail_at=at)


def parse_region(text: str, syntax: ToolSyntax, names: tuple[str, ...], closer: str | None,
                 final: bool) -> RegionScan:
    """The calls in a region's text; `closer` must end it when given; `final`: the output has
    ended (nothing more will come).

    A call is committed (reported) as soon as its name is read and the arguments' key follows:
    `{"name": "get_weather", "arguments": ` -> the call `get_weather`, whose arguments then grow
    as raw text until their JSON value closes. A call whose name is not one of `names`, or an
    object that is not a call, makes the region fail before anything was reported, so such text
    stays content. Arguments given as a JSON string and objects whose name comes after their
    arguments are reported once complete."""
    i = skip_ws(text, 0)
    if i == len(text):
        return _fail([], i) if final else _open([])
    if syntax.pythonic:
        calls, end = parse_pythonic(text, i, names, final)
        if calls is None:
            return _fail([], i)
        return _close(text, list(calls), end, syntax, closer, final) if end is not None else _open(list(calls))
    if syntax.named_args and text[i] not in "{[":
        return _named(text, i, syntax, names, closer, final)
    calls: list[ScanCall] = []
    listed = text[i] == "["
    if listed:
        i = skip_ws(text, i + 1)
    while True:
        if i == len(text):
            return _open(calls) if not final else _fail(calls, i)
        if text[i] != "{":
            return _fail(calls, i)
        call, end, ok = _call_object(text, i, names, final)
        if not ok:
            return _fail(calls, i)
        if call is not None:
            calls.append(call)
        if end is None:
            return _open(calls)
        i = skip_ws(text, end)
        if i == len(text) and not final:
            return _open(calls)  # a separator may still come
        if listed:
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            if i < len(text) and text[i] == "]":
                return _close(text, calls, i + 1, syntax, closer, final)
            return _fail(calls, i)
        if i < len(text) and text[i] in syntax.separators:
            i = skip_ws(text, i + 1)
            continue
        return _close(text, calls, i, syntax, closer, final)


def _close(text: str, calls: list[ScanCall], at: int, syntax: ToolSyntax, closer: str | None,
           final: bool) -> RegionScan:
    """The region after its calls: its closer (a missing one at the very end is forgiven), then
    any trailer the format drops."""
    j = skip_ws(text, at)
    end = at
    if closer is not None:
        if text.startswith(closer, j):
            end = j + len(closer)
        elif j == len(text) and final:
            end = j
        elif closer.startswith(text[j:]) and not final:
            return _open(calls)
        else:
            return _fail(calls, j)
    k = skip_ws(text, end)
    if k == len(text) and syntax.trailers and not final:  # a trailer may still come
        return _open(calls)
    for trailer in syntax.trailers:
        if text.startswith(trailer, k):
            return RegionScan(tuple(calls), end=k + len(trailer))
        if k < len(text) and trailer.startswith(text[k:]) and not final:
            return _open(calls)
    return RegionScan(tuple(calls), end=end)


def _call_object(text: str, at: int, names: tuple[str, ...], final: bool) -> tuple[ScanCall | None, int | None, bool]:
    """(the call read so far or None, the object's end or None, whether it may still be a call)."""
    m = _NAME_FIRST.match(text, at)
    if m is None:
        return _whole_object(text, at, names, final)
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None, None, False
    if name not in names:
        return None, None, False
    a = m.end()
    if a == len(text):
        return ScanCall(name, "", False), None, True
    if text[a] == '"':  # the arguments as JSON text: reported once that string is complete
        e = value_end(text, a, final)
        if e is INCOMPLETE:
            return ScanCall(name, "", False), None, True
        try:
            arguments = json.loads(text[a:e]) if e != MALFORMED else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, str) or not json_object(arguments):
            return None, None, False
    else:
        e = value_end(text, a, final)
        if e == MALFORMED:
            return None, None, False
        if e is INCOMPLETE:
            return ScanCall(name, text[a:], False), None, True
        arguments = text[a:e]
    call = ScanCall(name, arguments, True)
    k = skip_ws(text, e)
    if k == len(text):
        return call, None, not final
    if text[k] == "}":
        return call, k + 1, True
    if text[k] == ",":  # more keys after the arguments: the object ends where its brace closes
        end = value_end(text, at, final)
        return call, None if end is INCOMPLETE else end, end != MALFORMED
    return None, None, False


def _whole_object(text: str, at: int, names: tuple[str, ...], final: bool) -> tuple[ScanCall | None, int | None, bool]:
    """An object whose name does not come first: a call once complete, if it is one."""
    first = _FIRST_KEY.match(text, at)
    if first is not None and first.group(1) not in ("name", *ARGUMENT_KEYS):
        return None, None, False
    end = value_end(text, at, final)
    if end is INCOMPLETE:
        return None, None, True
    if end == MALFORMED:
        return None, None, False
    try:
        value = json.loads(text[at:end])
    except ValueError:
        return None, None, False
    key = next((k for k in ARGUMENT_KEYS if k in value), None) if isinstance(value, dict) else None
    if key is None or value.get("name") not in names:
        return None, None, False
    arguments = value[key]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not json_object(arguments):
        return None, None, False
    return ScanCall(value["name"], arguments, True), end, True


def _named(text: str, at: int, syntax: ToolSyntax, names: tuple[str, ...], closer: str | None,
           final: bool) -> RegionScan:
    """Mistral's newer `NAME[ARGS]{...}` (maybe `NAME[CALL_ID]id[ARGS]{...}`): one call."""
    k = text.find(_NAMED, at)
    if k < 0:
        head = text[at:]
        maybe = len(head) <= MAX_NAME_CHARS + len(_CALL_ID) + 64 and "\n" not in head
        return _open([]) if maybe and not final else _fail([], at)
    name = text[at:k].split(_CALL_ID, 1)[0].strip()
    if name not in names:
        return _fail([], at)
    a = skip_ws(text, k + len(_NAMED))
    e = value_end(text, a, final)
    if e == MALFORMED or (a < len(text) and text[a] != "{"):
        return _fail([], at)
    if e is INCOMPLETE:
        return _open([ScanCall(name, text[a:], False)])
    return _close(text, [ScanCall(name, text[a:e], True)], e, syntax, closer, final)
