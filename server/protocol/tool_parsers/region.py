"""One call region (the text after an opening marker) -> the calls it holds so far.

Design: `parse_region` reads the region's text and returns the calls found so far (a call's
arguments as far as they have been written) and whether the region has ended, is still open, or
turned out not to hold calls. The splitter (`splitter.py`) calls it again each time the text has
grown and diffs successive results into deltas, so what a stream sends and what a whole answer
holds come from the same reading. A `RegionMemo` (one per open region) makes the re-reading
incremental: it keeps the reading's place at the last call boundary (the calls before it are
complete and never change), each call's head once read (`{"name": ..., "arguments": `), and the
scans of whitespace and values (`jsonscan.Scans`), which resume where they stopped; so a region
of n characters costs O(n) however many pieces it arrives in. Trade-off: the heads' patterns
take at most 64 characters of whitespace between their tokens and a name of 64 characters: a
head beyond that is read as a whole object once it closes, not streamed as it is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.protocol.tool_parsers.jsonscan import INCOMPLETE, MALFORMED, PYTHON, Scans, loads
from server.protocol.tool_parsers.pythonic import parse_pythonic
from server.protocol.tool_parsers.syntax import ARGUMENT_KEYS, ScanCall, ToolSyntax

_S = r"\s{0,64}"  # whitespace between a head's tokens (bounded: a head is matched again until it is complete)
_NAME_FIRST = re.compile(rf'\{{{_S}"name"{_S}:{_S}"((?:[^"\\]|\\.){{0,128}})"{_S},{_S}"(?:arguments|parameters)"{_S}:')
_FIRST_KEY = re.compile(rf'\{{{_S}"((?:[^"\\]|\\.){{0,16}})"')
_NAMED = "[ARGS]"
_CALL_ID = "[CALL_ID]"
MAX_NAME_CHARS = 64  # a tool name is at most this long (OpenAI's limit): longer text is not a name
_NOT_A_CALL = (None, None, False)


@dataclass(frozen=True)
class RegionScan:
    """What a region holds so far; `end` (where it stopped, in its text) once it has ended,
    `failed` (at `fail_at`) when it is not, or stopped being, a list of calls."""

    calls: Sequence[ScanCall]  # the region's own list: read it before the region is read again
    end: int | None = None
    failed: bool = False
    fail_at: int = 0


@dataclass
class RegionMemo:
    """What one region's earlier readings found that later ones keep (its text only grows): the
    place at the last call boundary (`at`; None: nothing read yet), whether it is just past a
    call (`after`) or at a call's `{`, the calls before it (the first `count` of `done`), whether
    the calls are in a `[...]` list, each call's head and complete arguments, and the scans."""

    scans: Scans = field(default_factory=Scans)
    py: Scans = field(default_factory=lambda: Scans(PYTHON))
    at: int | None = None
    after: bool = False
    listed: bool = False
    done: list[ScanCall] = field(default_factory=list)
    count: int = 0
    heads: dict[int, tuple[str | None, int]] = field(default_factory=dict)  # `{` -> (name or None, past `:`)
    arguments: dict[int, tuple[ScanCall | None, int]] = field(default_factory=dict)  # `{` -> (call, its end)

    def keep(self, calls: list[ScanCall], at: int, after: bool) -> None:
        self.done, self.count, self.at, self.after = calls, len(calls), at, after

    def release(self) -> None:
        """Drop a call left open by the last reading (it holds the region's text, which can then
        grow in place)."""
        del self.done[self.count:]


def json_object(text: str) -> bool:
    """The text parses as a JSON object (what a call's arguments must be), nested within bounds."""
    try:
        return isinstance(loads(text), dict)
    except ValueError:
        return False


def _open(calls: list[ScanCall]) -> RegionScan:
    return RegionScan(calls)


def _fail(calls: list[ScanCall], at: int) -> RegionScan:
    return RegionScan(calls, failed=True, fail_at=at)


def parse_region(text: str, syntax: ToolSyntax, names: tuple[str, ...], closer: str | None,
                 final: bool, memo: RegionMemo | None = None) -> RegionScan:
    """The calls in a region's text; `closer` must end it when given; `final`: the output has
    ended (nothing more will come); `memo`: the region's earlier readings (its text only grew).

    A call is committed (reported) as soon as its name is read and the arguments' key follows:
    `{"name": "get_weather", "arguments": ` -> the call `get_weather`, whose arguments then grow
    as raw text until their JSON value closes. A call whose name is not one of `names`, or an
    object that is not a call, makes the region fail before anything was reported, so such text
    stays content. Arguments given as a JSON string and objects whose name comes after their
    arguments are reported once complete."""
    memo = memo if memo is not None else RegionMemo()
    skip_ws = memo.scans.skip_ws
    if memo.at is None:
        i = skip_ws(text, 0)
        if i == len(text):
            return _fail([], i) if final else _open([])
        if syntax.pythonic:
            calls, end = parse_pythonic(text, i, names, final, memo.py)
            if calls is None:
                return _fail([], i)
            if end is None:
                return _open(list(calls))
            return _close(text, list(calls), end, syntax, closer, final, memo)
        if syntax.named_args and text[i] not in "{[":
            return _named(text, i, syntax, names, closer, final, memo)
        memo.listed = text[i] == "["
        if memo.listed:
            i = skip_ws(text, i + 1)
        memo.keep([], i, False)
    calls, i, after, listed = memo.done, memo.at, memo.after, memo.listed
    del calls[memo.count:]  # a call the last reading left open is read again
    while True:
        if not after:  # 1. a call object starts here
            if i == len(text):
                return _open(calls) if not final else _fail(calls, i)
            if text[i] != "{":
                return _fail(calls, i)
            memo.keep(calls, i, False)
            call, end, ok = _call_object(text, i, names, final, memo)
            if not ok:
                return _fail(calls, i)
            if call is not None:
                calls.append(call)
            if end is None:
                return _open(calls)
            i, after = end, True
            memo.keep(calls, i, True)
        i = skip_ws(text, i)  # 2. after a call: a separator, the list's end, or the region's
        if i == len(text) and not final:
            return _open(calls)  # a separator may still come
        after = False
        if listed:
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            if i < len(text) and text[i] == "]":
                return _close(text, calls, i + 1, syntax, closer, final, memo)
            return _fail(calls, i)
        if i < len(text) and text[i] in syntax.separators:
            i = skip_ws(text, i + 1)
            continue
        return _close(text, calls, i, syntax, closer, final, memo)


def _close(text: str, calls: list[ScanCall], at: int, syntax: ToolSyntax, closer: str | None,
           final: bool, memo: RegionMemo) -> RegionScan:
    """The region after its calls: its closer (a missing one at the very end is forgiven), then
    any trailer the format drops."""
    j = memo.scans.skip_ws(text, at)
    end = at
    if closer is not None:
        if text.startswith(closer, j):
            end = j + len(closer)
        elif j == len(text) and final:
            end = j
        elif len(text) - j < len(closer) and closer.startswith(text[j:]) and not final:
            return _open(calls)
        else:
            return _fail(calls, j)
    k = memo.scans.skip_ws(text, end)
    if k == len(text) and syntax.trailers and not final:  # a trailer may still come
        return _open(calls)
    for trailer in syntax.trailers:
        if text.startswith(trailer, k):
            return RegionScan(calls, end=k + len(trailer))
        if k < len(text) and len(text) - k < len(trailer) and trailer.startswith(text[k:]) and not final:
            return _open(calls)
    return RegionScan(calls, end=end)


def _head(text: str, at: int, names: tuple[str, ...], memo: RegionMemo) -> tuple[str | None, int] | None:
    """(the name, or None when it is no listed tool; just past the arguments' `:`) of a call whose
    name comes first; None while that head is not (or not yet) written."""
    if at in memo.heads:
        return memo.heads[at]
    m = _NAME_FIRST.match(text, at)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        name = None
    memo.heads[at] = head = (name if name in names else None, m.end())
    return head


def _call_object(text: str, at: int, names: tuple[str, ...], final: bool,
                 memo: RegionMemo) -> tuple[ScanCall | None, int | None, bool]:
    """(the call read so far or None, the object's end or None, whether it may still be a call)."""
    head = _head(text, at, names, memo)
    if head is None:
        return _whole_object(text, at, names, final, memo)
    name, colon = head
    if name is None:
        return _NOT_A_CALL
    a = memo.scans.skip_ws(text, colon)
    if a == len(text):
        return ScanCall(name, "", False), None, True
    if at in memo.arguments:
        call, e = memo.arguments[at]
        if call is None:
            return _NOT_A_CALL
    else:
        e = memo.scans.value_end(text, a, final)
        if e == MALFORMED or (text[a] == '"' and e is not INCOMPLETE and not _string_object(text[a:e])):
            memo.arguments[at] = (None, 0)
            return _NOT_A_CALL
        if e is INCOMPLETE:  # arguments as JSON text are reported once that string is complete
            return (ScanCall(name, "", False) if text[a] == '"' else ScanCall(name, "", False, text, a)), None, True
        arguments = loads(text[a:e]) if text[a] == '"' else text[a:e]
        call = ScanCall(name, arguments, True)
        memo.arguments[at] = (call, e)
    k = memo.scans.skip_ws(text, e)
    if k == len(text):
        return call, None, not final
    if text[k] == "}":
        return call, k + 1, True
    if text[k] == ",":  # more keys after the arguments: the object ends where its brace closes
        end = memo.scans.value_end(text, at, final)
        return call, None if end is INCOMPLETE else end, end != MALFORMED
    return _NOT_A_CALL


def _string_object(quoted: str) -> bool:
    """A JSON string whose text is a JSON object (arguments some models send as text)."""
    try:
        value = loads(quoted)
    except ValueError:
        return False
    return isinstance(value, str) and json_object(value)


def _whole_object(text: str, at: int, names: tuple[str, ...], final: bool,
                  memo: RegionMemo) -> tuple[ScanCall | None, int | None, bool]:
    """An object whose name does not come first: a call once complete, if it is one."""
    first = _FIRST_KEY.match(text, at)
    if first is not None and first.group(1) not in ("name", *ARGUMENT_KEYS):
        return _NOT_A_CALL
    end = memo.scans.value_end(text, at, final)
    if end is INCOMPLETE:
        return None, None, True
    if end == MALFORMED:
        return _NOT_A_CALL
    try:
        value = loads(text[at:end])
    except ValueError:
        return _NOT_A_CALL
    key = next((k for k in ARGUMENT_KEYS if k in value), None) if isinstance(value, dict) else None
    if key is None or value.get("name") not in names:
        return _NOT_A_CALL
    arguments = value[key]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not json_object(arguments):
        return _NOT_A_CALL
    return ScanCall(value["name"], arguments, True), end, True


def _named(text: str, at: int, syntax: ToolSyntax, names: tuple[str, ...], closer: str | None,
           final: bool, memo: RegionMemo) -> RegionScan:
    """Mistral's newer `NAME[ARGS]{...}` (maybe `NAME[CALL_ID]id[ARGS]{...}`): one call."""
    limit = MAX_NAME_CHARS + len(_CALL_ID) + 64
    k = text.find(_NAMED, at, at + limit + len(_NAMED))
    if k < 0:
        head = text[at:at + limit + 1]
        maybe = len(head) <= limit and "\n" not in head
        return _open([]) if maybe and not final else _fail([], at)
    name = text[at:k].split(_CALL_ID, 1)[0].strip()
    if name not in names:
        return _fail([], at)
    a = memo.scans.skip_ws(text, k + len(_NAMED))
    e = memo.scans.value_end(text, a, final)
    if e == MALFORMED or (a < len(text) and text[a] != "{"):
        return _fail([], at)
    if e is INCOMPLETE:
        return _open([ScanCall(name, "", False, text, a)])
    return _close(text, [ScanCall(name, text[a:e], True)], e, syntax, closer, final, memo)
