"""Where a JSON value ends, in text that may still be growing.

A tool call's arguments stream while the model writes them: the splitter needs to know, at
each piece, whether the arguments object is complete and where it stops, without parsing it
(it is not valid JSON until it is complete). `value_end` walks the text once, tracking string
state and bracket depth, which is all that is needed to find the end of an object, array,
string, number or literal. Trade-off: it checks structure, not validity (`{"a" 1}` ends where
its brace closes); the whole value is parsed with `json.loads` once complete.
"""

from __future__ import annotations

_WS = " \t\r\n"
_SCALAR = set("0123456789+-.eEtruefalsn")  # the characters of numbers, true, false and null
INCOMPLETE, MALFORMED = None, -1


def skip_ws(text: str, i: int) -> int:
    """The first position at or after `i` that is not JSON whitespace."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """The position just past the JSON value that starts at `text[i]`; `INCOMPLETE` (None) when
    the text ends inside it, `MALFORMED` (-1) when `text[i]` cannot start a value or a bracket
    closes the wrong one. A scalar at the very end is complete only when `final`."""
    n = len(text)
    if i >= n:
        return INCOMPLETE
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        return _bracket_end(text, i)
    if c in _SCALAR:
        j = i
        while j < n and text[j] in _SCALAR:
            j += 1
        return j if j < n or final else INCOMPLETE
    return MALFORMED


def _string_end(text: str, i: int) -> int | None:
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return INCOMPLETE


def _bracket_end(text: str, i: int) -> int | None:
    closing = {"{": "}", "[": "]"}
    stack = [closing[text[i]]]
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is INCOMPLETE:
                return INCOMPLETE
            j = end
            continue
        if c in closing:
            stack.append(closing[c])
        elif c in "}]":
            if c != stack.pop():
                return MALFORMED
            if not stack:
                return j + 1
        j += 1
    return INCOMPLETE
