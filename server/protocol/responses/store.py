"""Stored responses, for `previous_response_id` (and `GET /v1/responses/{id}`), in memory and bounded.

A response stored (`store`, true by default as OpenAI has it) keeps the conversation it ends:
the input items it was given (after its own `previous_response_id`'s) and its output items,
which are input items themselves, so a follow-up request continues from exactly what the
model saw and said; and the response object, which `GET` returns. Design: both are kept as the
JSON bytes they were serialized to once, and counted by `len` of those bytes (plus a fixed
allowance per entry for its bookkeeping), so what is counted is what is held: a parsed history
costs many times its JSON in Python objects. A continuation appends its items' JSON to the
history's bytes, never re-serializing what is stored, and parses the history once (in a
worker thread: `server/edge/routes/responses.py`). Bounds: per conversation, items and bytes
(`MAX_CONVERSATION_ITEMS`, `MAX_CONVERSATION_BYTES`: a request that would continue past them is
refused by name, since dropping the oldest items would change what the model sees without the
client knowing); for the whole store, entries and bytes (`MAX_RESPONSES`, `MAX_BYTES`: the
least recently used go first, and a request naming one that is gone is told so, 404).
Trade-off: nothing survives a restart and each router holds its own (OpenAI keeps them 30
days); a client that needs more sends the whole conversation as `input` instead.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1024
MAX_BYTES = 64 * 1024 * 1024  # every stored conversation and response, as counted by `Stored.size`
MAX_CONVERSATION_ITEMS = 10_000  # items one conversation may hold (the history and a request's input)
MAX_CONVERSATION_BYTES = 16 * 1024 * 1024  # ... and their JSON
ENTRY_BYTES = 512  # an entry's bookkeeping beside its bytes (id, objects, the map's node): an upper bound


@dataclass(frozen=True)
class Stored:
    """One stored response: the conversation's items up to and including its output (a JSON
    array, UTF-8), how many there are, and the response object (JSON) as it was answered."""

    items: bytes
    count: int
    response: bytes

    @property
    def size(self) -> int:
        return len(self.items) + len(self.response) + ENTRY_BYTES


def items_json(items: list[dict]) -> bytes:
    """Items as the JSON array a `Stored` keeps."""
    return json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode()


def join_items(held: bytes, more: bytes) -> bytes:
    """Two JSON arrays of items as one, without parsing either."""
    if held == b"[]":
        return more
    if more == b"[]":
        return held
    return held[:-1] + b"," + more[1:]


def check_conversation(history: Stored | None, previous: str, items: int, size: int) -> None:
    """`ValueError` naming the bound when `previous`'s history and a request's `items` (of JSON
    `size` bytes) would hold more than one conversation may."""
    held, held_bytes = (history.count, len(history.items)) if history is not None else (0, 0)
    if held + items > MAX_CONVERSATION_ITEMS:
        raise ValueError(f"`previous_response_id` `{previous[:80]}` holds {held} items and `input` {items}: more than "
                         f"the {MAX_CONVERSATION_ITEMS} items a stored conversation may hold. Accepted: at most "
                         f"{MAX_CONVERSATION_ITEMS} in all, or the conversation you need as `input` without "
                         "`previous_response_id`")
    if held_bytes + size > MAX_CONVERSATION_BYTES:
        raise ValueError(f"`previous_response_id` `{previous[:80]}` holds {held_bytes} bytes of items and `input` "
                         f"{size}: more than the {MAX_CONVERSATION_BYTES} bytes a stored conversation may hold. "
                         f"Accepted: at most {MAX_CONVERSATION_BYTES} bytes of items in all, or the conversation you "
                         "need as `input` without `previous_response_id`")


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, entry: Stored) -> bool:
        """Keep `entry` (the least recently used go to make room); False when it is larger than
        the whole store, and kept nowhere."""
        if entry.size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(rid, None)
            self._bytes -= old.size if old else 0
            self._entries[rid] = entry
            self._bytes += entry.size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is not None:
                self._entries.move_to_end(rid)
            return entry

    @property
    def bytes(self) -> int:
        """What the stored entries hold, as `Stored.size` counts it."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def metrics(self) -> str:
        """The store's Prometheus series."""
        return ("# HELP hetserve_router_responses_stored Responses kept for `previous_response_id`.\n"
                "# TYPE hetserve_router_responses_stored gauge\n"
                f"hetserve_router_responses_stored {len(self)}.0\n"
                "# HELP hetserve_router_responses_stored_bytes Bytes the kept responses hold (their JSON and "
                f"{ENTRY_BYTES} per entry).\n"
                "# TYPE hetserve_router_responses_stored_bytes gauge\n"
                f"hetserve_router_responses_stored_bytes {self._bytes}.0\n")
