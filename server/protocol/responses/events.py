"""A streamed response: chat choice deltas in, OpenAI's typed `response.*` events out.

Design: `ResponseEvents` is a small state machine over one choice's deltas (what `ChoiceStream`
gives the chat route), holding at most one open output item; a delta of another kind closes the
open item first, so items go out whole and in order, and the final response's output items are
the ones streamed, same ids. Trade-off: reasoning goes out as `response.reasoning_text.delta` on
the item's content, not as a summary (the model writes none).
"""

from __future__ import annotations

import json
import time

from server.protocol.responses import output as out

_REASONING, _MESSAGE, _CALL = "reasoning", "message", "function_call"


class ResponseEvents:
    """One response's events; `req` is its `ResponsesRequest`.

    Reasoning deltas open a `reasoning` item, content deltas a `message` item (with its one
    `output_text` part), a tool call's start a `function_call` item; closing an item sends its
    `.done` events with the whole text, the item its final state. The order is OpenAI's:
    `response.created`, `response.in_progress`, per item `response.output_item.added` (then
    `response.content_part.added` for text) ... deltas ... `.done` events,
    `response.output_item.done`, and at the end `response.completed` (or `response.incomplete`
    when the length limit cut it) with the whole response. Every event has its
    `sequence_number`; each SSE frame names its event type too (`event: response.created`)."""

    def __init__(self, rid: str, model: str, req):
        self.rid, self.model, self.req = rid, model, req
        self.created = int(time.time())
        self.items: list[dict] = []  # output items so far (the open one last)
        self._seq = 0
        self._open: str | None = None  # the kind of the open item, if any
        self._text = ""  # the open item's text (reasoning, message) or arguments (a call)
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.response: dict | None = None  # the final response object, once finished

    # -- frames ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _snapshot(self, status: str, use: dict | None = None) -> dict:
        return out.response_object(self.rid, self.model, self.req, list(self.items) if status != "in_progress" else [],
                                   status, use, self.created)

    def start(self) -> str:
        snapshot = self._snapshot("in_progress")
        return (self._event("response.created", response=snapshot)
                + self._event("response.in_progress", response=snapshot))

    # -- items ----------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _begin(self, kind: str, item: dict) -> str:
        frames = self._close()
        self.items.append(item)
        self._open, self._text = kind, ""
        frames += self._event("response.output_item.added", output_index=self._index, item=item)
        if kind == _MESSAGE:
            frames += self._event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                  content_index=0, part=out.output_text(""))
        elif kind == _REASONING:
            frames += self._event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                  content_index=0, part={"type": "reasoning_text", "text": ""})
        return frames

    def _close(self, status: str = "completed") -> str:
        if self._open is None:
            return ""
        item, kind, text, at = self.items[-1], self._open, self._text, self._index
        self._open = None
        if kind == _MESSAGE:
            done = out.message_item(text, status, item["id"])
            frames = (self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=text, logprobs=[])
                      + self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                    content_index=0, part=done["content"][0]))
        elif kind == _REASONING:
            done = out.reasoning_item(text, status, item["id"])
            part = done["content"][0]
            frames = (self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=text)
                      + self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                    content_index=0, part=part))
        else:
            done = out.call_item(item["call_id"], item["name"], text, status, item["id"])
            frames = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                 name=item["name"], arguments=text)
        self.items[-1] = done
        return frames + self._event("response.output_item.done", output_index=at, item=done)

    def _reasoning(self, text: str) -> str:
        frames = "" if self._open == _REASONING else self._begin(_REASONING, {
            "type": "reasoning", "id": out.item_id("rs"), "summary": [], "content": [], "status": "in_progress"})
        self._text += text
        return frames + self._event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                    output_index=self._index, content_index=0, delta=text)

    def _content(self, text: str) -> str:
        frames = "" if self._open == _MESSAGE else self._begin(_MESSAGE, {
            "type": "message", "id": out.item_id("msg"), "role": "assistant", "status": "in_progress",
            "content": []})
        self._text += text
        return frames + self._event("response.output_text.delta", item_id=self.items[-1]["id"],
                                    output_index=self._index, content_index=0, delta=text, logprobs=[])

    def _call(self, call: dict) -> str:
        frames = ""
        function = call.get("function") or {}
        if call.get("id"):  # a call's start: its id and name
            frames = self._begin(_CALL, out.call_item(call["id"], function.get("name", ""), "", "in_progress"))
            self._calls[call.get("index", 0)] = self._index
        arguments = function.get("arguments") or ""
        if arguments and self._open == _CALL and self._calls.get(call.get("index", 0)) == self._index:
            self._text += arguments
            frames += self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                  output_index=self._index, delta=arguments)
        return frames

    # -- the entry points ---------------------------------------------------------------------
    def deltas(self, deltas: list[dict], choice) -> str:
        """The events of some chat deltas of `choice` (a `ChoiceStream`), the last ones at its finish."""
        frames = []
        for d in deltas:
            delta = d.get("delta") or {}
            if delta.get("reasoning_content"):
                frames.append(self._reasoning(delta["reasoning_content"]))
            if delta.get("content"):
                frames.append(self._content(delta["content"]))
            for call in delta.get("tool_calls") or ():
                frames.append(self._call(call))
            if d.get("finish_reason") is not None:
                frames.append(self._finish(d["finish_reason"], choice))
        return "".join(frames)

    def _finish(self, finish: str, choice) -> str:
        status = "incomplete" if finish == "length" else "completed"
        frames = self._close(status)
        self.response = self._snapshot(status, out.usage(choice.prompt_tokens, choice.completion_tokens))
        return frames + self._event(f"response.{status}", response=self.response)

    def failed(self, message: str) -> str:
        """The error event of a stream no worker could finish."""
        return self._event("error", code="incomplete_generation", message=message, param=None)
