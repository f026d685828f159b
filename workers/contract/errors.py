"""The error answers both processes give: who is at fault, and how a client's value is quoted.

Design: the worker answers every refusal as `{"error", "error_type"}` (a stream: one last event
of that shape), and the router reads `error_type` to tell a request fault from a worker fault. A
request fault (`validation`, 422; `request_failed`, 500: this one request raised, the worker
serves on) is answered to the client as it is: never retried, never counted by the circuit
breaker, never a reason to move a stream, since the next worker would fail it the same way;
everything else on a 5xx is the worker's. An error quotes a client's value through `shown()`
(at most `SHOWN_CHARS`, escaped so any text encodes, a lone surrogate included), and
`safe_message()` applies the same to a finished message, the last line of defence in both
error handlers. Trade-off: a worker bug that only some requests hit is never isolated by the
breaker; its requests fail on their own instead of taking the worker's other clients with them."""

from __future__ import annotations

import re

ERROR_VALIDATION = "validation"  # 422: the request is wrong or cannot be served
ERROR_REQUEST_FAILED = "request_failed"  # 500: this request raised on the worker, which serves on
ERROR_INTERNAL = "internal"  # 500: the worker failed (its engine, a bug outside one request)
REQUEST_FAULTS = frozenset({ERROR_VALIDATION, ERROR_REQUEST_FAILED})

SHOWN_CHARS = 64  # characters of a client's value an error message quotes
MAX_MESSAGE_CHARS = 2000  # an error message is cut here, whatever built it

_QUOTED = re.compile(r"`([^`]*)`")
_ALREADY_SHOWN = re.compile(r"\.\.\. \(\d+ characters\)\Z")  # shown() cut it already: kept as it is


def encodable(text: str) -> str:
    """`text` with whatever UTF-8 cannot encode (lone surrogates) as backslash escapes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """A client's value as an error message quotes it: at most `limit` characters, then how
    long it was, always encodable, so a megabyte value is never echoed back whole."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return encodable(text)


def safe_message(message: str) -> str:
    """A finished error message with every backticked value quoted by `shown()`, cut at
    `MAX_MESSAGE_CHARS` and encodable."""
    def quote(m: re.Match) -> str:
        value = m.group(1)
        kept = len(value) <= SHOWN_CHARS + 32 and _ALREADY_SHOWN.search(value)
        return f"`{value if kept else shown(value)}`"

    text = _QUOTED.sub(quote, message)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "..."
    return encodable(text)


def is_request_fault(error_type: str | None) -> bool:
    """Does this `error_type` blame the request (not the worker)?"""
    return error_type in REQUEST_FAULTS
