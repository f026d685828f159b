"""The pythonic tool-call format: `[get_weather(city="Paris"), get_time()]` -> calls.

Llama 3.2's and Llama 4's pythonic templates (and ToolACE-style models) ask the model to answer
a call as a Python list of calls with keyword arguments. The list is found by a bracket scan
that knows Python's quoted strings, then parsed with `ast` (never evaluated): every element must
be a call of a listed tool by name, every argument a keyword whose value is a literal
(`ast.literal_eval`: strings, numbers, booleans, None, lists, dicts), so arbitrary code is text,
not a call. The arguments become JSON. Trade-off: the calls go out once the list closes, not
argument by argument as the JSON formats stream, since the JSON text only exists once a
value is complete.
"""

from __future__ import annotations

import ast
import json

from server.protocol.tool_parsers.jsonscan import INCOMPLETE, MALFORMED, PYTHON, Scans, too_deep
from server.protocol.tool_parsers.syntax import ScanCall
from workers.contract.json_schema import MAX_JSON_DEPTH


def list_end(text: str, at: int, scans: Scans | None = None) -> int | None:
    """Just past the Python list that opens at `text[at]`; `INCOMPLETE` or `MALFORMED`. `scans`:
    the earlier scans of the same growing text, resumed where they stopped."""
    return (scans if scans is not None else Scans(PYTHON)).value_end(text, at)


def _call(node: ast.expr, names: tuple[str, ...]) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)  # `get_weather`, or a dotted `weather.get`
    if name not in names:
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if len(arguments) != len(node.keywords):  # `**kwargs`
        return None
    return name, text


def parse_pythonic(text: str, at: int, names: tuple[str, ...], final: bool, scans: Scans | None = None):
    """(calls as `ScanCall`s, the list's end) once the list at `text[at]` is complete; ((), None)
    while it may still be one; (None, None) when it is not a list of listed calls (or nests
    deeper than any call's arguments may)."""
    if text[at] != "[":
        return None, None
    end = list_end(text, at, scans)
    if end == MALFORMED or (end is INCOMPLETE and final):
        return None, None
    if end is INCOMPLETE:
        return (), None
    if too_deep(text[at:end], MAX_JSON_DEPTH + 2, PYTHON):  # the list and a call's parentheses, then arguments
        return None, None
    try:
        tree = ast.parse(text[at:end], mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None, None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None, None
    calls = [_call(node, names) for node in tree.body.elts]
    if any(c is None for c in calls):
        return None, None
    return tuple(ScanCall(name, arguments, True) for name, arguments in calls), end
