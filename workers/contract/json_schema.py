"""A JSON schema as requests carry it: an object, or the same as JSON text (TGI clients send
both). One reading for the router, which checks well-formedness at its edge, and the worker,
which compiles it (and says what it cannot enforce). No torch, no grammar engine here.

Free-form JSON a request carries (a schema, tool parameters, template variables) is walked
once by `check_json_value`, iteratively: at most `MAX_JSON_DEPTH` levels of nesting (deeper
values reached Python's recursion limit on their way to the worker: a `RecursionError`, a
500) and only valid Unicode in its strings and keys (a lone surrogate cannot be encoded for
the tokenizer or the grammar engine). Trade-off: one more pass over such values at each
edge, linear in their size, against a 500 for a 1 KB body.
"""

from __future__ import annotations

import json

from workers.contract.errors import shown

MAX_JSON_DEPTH = 64  # levels of nesting in a free-form JSON value (OpenAI allows 10 levels of schema objects)


def load_json_schema(value, what: str) -> dict | bool:
    """The schema as a JSON value; `ValueError` naming `what` when it is not JSON, not a schema,
    nested deeper than `MAX_JSON_DEPTH` or not valid Unicode."""
    if isinstance(value, str):
        check_json_value(value, what)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{what} is not valid JSON: {shown(str(e))}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"{what} must be a JSON schema (an object), got `{type(value).__name__}`")
    check_json_value(value, what)
    return value


def check_json_value(value, what: str, max_depth: int = MAX_JSON_DEPTH):
    """`value` itself when it nests at most `max_depth` levels and every string and key is
    valid Unicode; `ValueError` naming `what` otherwise."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, what)
            continue
        if not isinstance(item, dict | list | tuple):
            continue
        if depth > max_depth:
            raise ValueError(f"{what} nests deeper than {max_depth} levels. Accepted: at most {max_depth} "
                             "levels of objects and arrays")
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str):
                    _check_text(key, what)
                stack.append((child, depth + 1))
        else:
            stack.extend((child, depth + 1) for child in item)
    return value


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode()
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate `{bad}`. Accepted: text whose "
                         "\\ud800-\\udfff escapes come in valid pairs") from None
