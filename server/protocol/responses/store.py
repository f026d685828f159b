"""Stored responses, for `previous_response_id` (and `GET /v1/responses/{id}`), in memory and bounded.

A response stored (`store`, true by default as OpenAI has it) keeps the conversation it ends:
the input items it was given (after its own `previous_response_id`'s) and its output items,
which are input items themselves, so a follow-up request continues from exactly what the
model saw and said; and the response object, which `GET` returns. Design: one
least-recently-used map with two bounds, entries and characters of JSON (`MAX_RESPONSES`,
`MAX_CHARS`), so a long agent run or a flood of requests cannot grow the router's memory
without limit; the oldest go first, and a request naming one that is gone is told so (404).
Trade-off: nothing survives a restart and each router holds its own (OpenAI keeps them 30
days); a client that needs more sends the whole conversation as `input` instead.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1024
MAX_CHARS = 64 * 1024 * 1024  # of the stored items' and responses' JSON, all together


@dataclass(frozen=True)
class Stored:
    """One stored response: the conversation's items up to and including its output, and itself."""

    items: tuple[dict, ...]
    response: dict
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, rid: str, items: list[dict], response: dict) -> None:
        chars = len(json.dumps(items)) + len(json.dumps(response))
        if chars > self.max_chars:  # larger than the whole store: kept nowhere
            return
        with self._lock:
            old = self._entries.pop(rid, None)
            self._chars -= old.chars if old else 0
            self._entries[rid] = Stored(tuple(items), response, chars)
            self._chars += chars
            while len(self._entries) > self.max_responses or self._chars > self.max_chars:
                _, gone = self._entries.popitem(last=False)
                self._chars -= gone.chars

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    def __len__(self) -> int:
        return len(self._entries)
