"""Where a JSON value ends, in text that may still be growing; parsing model output safely.

A tool call's arguments stream while the model writes them: the splitter needs to know, at
each piece, whether the arguments object is complete and where it stops, without parsing it
(it is not valid JSON until it is complete). A scan tracks string state and bracket depth,
which is all that is needed to find the end of an object, array, string, number or literal.
Design: a scan's state (where it stopped, the brackets still open, the open quote) is kept, so
that `Scans`, the scans of one growing text, resumes each one where it stopped when the text
has grown: reading a region of n characters costs O(n) however finely it arrives, not O(n)
per piece; runs of characters that change no state are skipped by regular expressions. The
same scanner, with Python's quotes and brackets, finds the end of a pythonic call list.
Trade-off: it checks structure, not validity (`{"a" 1}` ends where its brace closes); the
whole value is parsed once complete, by `loads`, which bounds the nesting first (json.loads
recurses, and a model can be made to write a thousand brackets: model output too deep is
not JSON here, never a `RecursionError`).
"""

from __future__ import annotations

import json
import re

from workers.contract.json_schema import MAX_JSON_DEPTH

_WS_RUN = re.compile(r"[ \t\r\n]*")
_SCALAR = set("0123456789+-.eEtruefalsn")  # the characters of numbers, true, false and null
_SCALAR_RUN = re.compile(r"[0-9+\-.eEtruefalsn]*")
INCOMPLETE, MALFORMED = None, -1


class Flavor:
    """The quotes and brackets of a language: JSON's, or Python's (for pythonic call lists)."""

    def __init__(self, quotes: str, pairs: dict[str, str]):
        self.quotes, self.pairs, self.closers = quotes, pairs, "".join(pairs.values())
        special = re.escape(quotes + "".join(pairs) + self.closers)
        self.plain = re.compile(f"[^{special}]*")  # outside strings: what changes no state
        self.body = {q: re.compile(f"[^{re.escape(q)}\\\\]*") for q in quotes}  # inside: up to the quote or `\`


JSON = Flavor('"', {"{": "}", "[": "]"})
PYTHON = Flavor("'\"", {"[": "]", "(": ")", "{": "}"})


class _Scan:
    """One value's scan so far: where it stopped, the closers still due, the open quote."""

    __slots__ = ("at", "stack", "quote", "end")

    def __init__(self, at: int, stack: list[str] | None, quote: str | None):
        self.at, self.stack, self.quote, self.end = at, stack, quote, None


def _advance(text: str, s: _Scan, flavor: Flavor) -> None:
    """Scan on from `s.at` to the value's end (then `s.end`) or the end of the text."""
    at, n, stack = s.at, len(text), s.stack
    while at < n:
        if s.quote is not None:  # 1. inside a string: to its quote, stepping over escapes
            at = flavor.body[s.quote].match(text, at).end()
            if at >= n:
                break
            if text[at] == "\\":
                if at + 1 >= n:
                    break  # what it escapes is still to come: resume at the backslash
                at += 2
                continue
            at, s.quote = at + 1, None
            if not stack:
                s.end = at
                break
            continue
        at = flavor.plain.match(text, at).end()  # 2. outside: to the next quote or bracket
        if at >= n:
            break
        c = text[at]
        at += 1
        if c in flavor.quotes:
            s.quote = c
        elif c in flavor.pairs:
            stack.append(flavor.pairs[c])
        elif not stack or c != stack.pop():  # 3. a closer: the wrong one is malformed
            s.end = MALFORMED
            break
        elif not stack:
            s.end = at
            break
    s.at = at


class Scans:
    """The scans of one text that only grows between calls (a call region as it streams): each
    whitespace run and value is scanned from where the last call on the same start stopped."""

    def __init__(self, flavor: Flavor = JSON):
        self.flavor = flavor
        self._ws: dict[int, int] = {}
        self._values: dict[int, _Scan] = {}

    def skip_ws(self, text: str, i: int) -> int:
        """The first position at or after `i` that is not JSON whitespace."""
        j = _WS_RUN.match(text, self._ws.get(i, i)).end()
        self._ws[i] = j
        return j

    def value_end(self, text: str, i: int, final: bool = False) -> int | None:
        """The position just past the value that starts at `text[i]`; `INCOMPLETE` (None) when
        the text ends inside it, `MALFORMED` (-1) when `text[i]` cannot start a value or a
        bracket closes the wrong one. A scalar at the very end is complete only when `final`."""
        if i >= len(text):
            return INCOMPLETE
        s = self._values.get(i)
        if s is None:
            s = self._start(text[i], i)
            if s is None:
                return MALFORMED
            self._values[i] = s
        if s.end is None and s.stack is None:  # a number or literal: its run of scalar characters
            s.at = _SCALAR_RUN.match(text, s.at).end()
            if s.at < len(text):
                s.end = s.at
        elif s.end is None:
            _advance(text, s, self.flavor)
        if s.end is None:
            return s.at if final and s.stack is None else INCOMPLETE
        return s.end

    def _start(self, c: str, i: int) -> _Scan | None:
        if c in self.flavor.quotes:
            return _Scan(i + 1, [], c)
        if c in self.flavor.pairs:
            return _Scan(i + 1, [self.flavor.pairs[c]], None)
        if self.flavor is JSON and c in _SCALAR:
            return _Scan(i, None, None)
        return None


def skip_ws(text: str, i: int) -> int:
    """The first position at or after `i` that is not JSON whitespace."""
    return _WS_RUN.match(text, i).end()


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """`Scans.value_end` on a text read once."""
    return Scans().value_end(text, i, final)


def too_deep(text: str, limit: int = MAX_JSON_DEPTH, flavor: Flavor = JSON) -> bool:
    """Whether brackets outside strings nest deeper than `limit` anywhere in `text` (read once,
    iteratively)."""
    if sum(text.count(c) for c in flavor.pairs) <= limit:
        return False
    depth, at, n, quote = 0, 0, len(text), None
    while at < n:
        if quote is not None:
            at = flavor.body[quote].match(text, at).end()
            if at < n:
                at, quote = (at + 2, quote) if text[at] == "\\" else (at + 1, None)
            continue
        at = flavor.plain.match(text, at).end()
        if at >= n:
            break
        c = text[at]
        at += 1
        if c in flavor.quotes:
            quote = c
        elif c in flavor.pairs:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def loads(text: str, limit: int = MAX_JSON_DEPTH):
    """`json.loads` of model output, whose nesting nothing has bounded: `ValueError` when it is
    not JSON or nests deeper than `limit` levels (a call's arguments that deep could not be sent
    back in a conversation either)."""
    if too_deep(text, limit):
        raise ValueError(f"nests deeper than {limit} levels")
    try:
        return json.loads(text)
    except RecursionError:  # deeper than the stack allows here, though within the limit
        raise ValueError(f"nests deeper than this process can parse (limit {limit} levels)") from None
