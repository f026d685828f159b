"""Anthropic answers: a chat choice -> a `message` with content blocks, whole or as Anthropic's
stream events (pure translation, no I/O).

Blocks, in order: `thinking` (the choice's `reasoning_content`; `signature` empty: this server
signs nothing and ignores the signature it gets back), `text` (its content), one `tool_use` per
tool call (`input` the arguments as an object). `stop_reason`: `tool_use` when it called a tool,
`max_tokens` when the length limit cut it, `stop_sequence` (with the string) when one of
`stop_sequences` ended it, else `end_turn`. Design: the chat route's choice is the one source,
so a greedy answer is the same text whichever protocol asked; the trade-off is a translation per
answer and no Anthropic feature the chat pipeline lacks.
"""

from __future__ import annotations

import json
import uuid

from server.protocol.tool_parsers.jsonscan import loads

_THINKING, _TEXT, _TOOL = "thinking", "text", "tool_use"


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_id(call_id: str) -> str:
    """A chat tool call's id as Anthropic spells its ids (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(finish: str | None, called: bool, matched, stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice (`matched`: the worker's `stop_reason`)."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return "end_turn", None


def _input(arguments: str) -> dict | None:
    try:
        value = loads(arguments or "{}")  # model output: its nesting bounded, never a RecursionError
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def message_object(mid: str, model: str, choice: dict, use: dict, stops: list[str] | None) -> dict:
    """The whole `message` for a chat choice."""
    message = choice.get("message") or {}
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or ()
    for call in calls:
        arguments = call["function"]["arguments"]
        parsed = _input(arguments)
        if parsed is None:  # arguments that are not an object (a broken harmony call): their text
            content.append({"type": "text", "text": arguments})
            continue
        content.append({"type": "tool_use", "id": tool_id(call["id"]), "name": call["function"]["name"],
                        "input": parsed})
    reason, sequence = stop_of(choice.get("finish_reason"), bool(calls), choice.get("stop_reason"), stops)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": use}


def _frame(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


class MessageEvents:
    """One streamed message's events: `message_start` (usage so far: the prompt's tokens,
    counted by the worker that took the stream), `ping`, then per block `content_block_start`,
    its deltas (`thinking_delta`, `text_delta`, `input_json_delta` with the arguments as the
    model writes them) and `content_block_stop`; at the end `message_delta` (stop reason and
    usage, `input_tokens` included, as the generating worker reports them at the end) and
    `message_stop`; an `error` event when no worker can finish the stream. Each SSE frame
    carries its event name (`event: content_block_delta`), as Anthropic's clients read it."""

    def __init__(self, mid: str, model: str, stops: list[str] | None):
        self.mid, self.model, self.stops = mid, model, stops
        self._open: str | None = None  # the kind of the open block
        self._index = -1  # the open block's index
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its block index
        self._called = False

    def start(self, input_tokens: int = 0) -> str:
        """`message_start` (with the prompt's tokens, as Anthropic's clients read the context's size
        from it) and a `ping`."""
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage(input_tokens, 0)}
        return _frame("message_start", {"message": message}) + _frame("ping", {})

    def _begin(self, kind: str, block: dict) -> str:
        frames = self._close()
        self._open, self._index = kind, self._index + 1
        return frames + _frame("content_block_start", {"index": self._index, "content_block": block})

    def _close(self) -> str:
        if self._open is None:
            return ""
        self._open = None
        return _frame("content_block_stop", {"index": self._index})

    def _delta(self, delta: dict) -> str:
        return _frame("content_block_delta", {"index": self._index, "delta": delta})

    def deltas(self, deltas: list[dict], choice) -> str:
        """The events of some chat deltas of `choice` (a `ChoiceStream`), the last ones at its finish."""
        frames = []
        for d in deltas:
            delta = d.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._open != _THINKING:
                    frames.append(self._begin(_THINKING, {"type": "thinking", "thinking": "", "signature": ""}))
                frames.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self._open != _TEXT:
                    frames.append(self._begin(_TEXT, {"type": "text", "text": ""}))
                frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                frames.append(self._call(call))
            if d.get("finish_reason") is not None:
                frames.append(self._finish(d, choice))
        return "".join(frames)

    def _call(self, call: dict) -> str:
        function = call.get("function") or {}
        frames = ""
        if call.get("id"):
            self._called = True
            frames = self._begin(_TOOL, {"type": "tool_use", "id": tool_id(call["id"]),
                                         "name": function.get("name", ""), "input": {}})
            self._calls[call.get("index", 0)] = self._index
        arguments = function.get("arguments") or ""
        if arguments and self._open == _TOOL and self._calls.get(call.get("index", 0)) == self._index:
            frames += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return frames

    def _finish(self, d: dict, choice) -> str:
        reason, sequence = stop_of(d["finish_reason"], self._called, d.get("stop_reason"), self.stops)
        use = {"input_tokens": choice.prompt_tokens, "output_tokens": choice.completion_tokens}
        return (self._close() + _frame("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                         "usage": use})
                + _frame("message_stop", {}))

    def failed(self, message: str) -> str:
        return _frame("error", {"error": {"type": "api_error", "message": message}})
