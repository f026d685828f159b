"""One worker answer -> one OpenAI choice, whole (`completion_choice`, `chat_choice`) or as a
stream of deltas (`ChoiceStream`).

A choice knows what its request asked for (`ChoiceSpec`: logprobs, `echo`, and for chat the
`ToolPlan` and the reasoning plan), so the whole answer and the stream are built from one
description. A chat choice with a `ReasoningPlan` sends the model's thinking as
`reasoning_content` and only the answer as `content`, which is also what tool calls are parsed
from; one with a `HarmonyPlan` (gpt-oss) reads the output's messages instead, harmony's special
tokens included (their text comes in the token events, never in `generated_text`). Usage and
logprobs still count every generated token; `finish_reason` is `tool_calls` when the output made
a call and was not cut by the length limit. Trade-off: a stream holds back text that may still
become a call or a tag until it cannot, so a client sees that text a little after it was written.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.protocol.harmony import (
    ARGUMENTS,
    CONTENT,
    REASONING,
    TAGS,
    TOOL_CALL,
    HarmonyPlan,
    HarmonySplitter,
    Part,
    output_text,
    split_harmony,
)
from server.protocol.openai import responses as fmt
from server.protocol.openai.tools import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    ToolPlan,
    call_id,
    tool_calls_message,
)
from server.protocol.reasoning import ReasoningPlan, ReasoningSplitter, split_reasoning
from server.protocol.tool_parsers.splitter import ToolCallSplitter, split_tool_calls

_NO_TOOLS = ToolPlan(NONE)


@dataclass(frozen=True)
class ChoiceSpec:
    """What one choice reports: `top` alternatives (None: no logprobs), echo of the prompt."""

    index: int
    top: int | None = None
    echo: bool = False
    prompt_text: str | None = None  # the prompt as text (None: given as token ids)
    tools: ToolPlan = _NO_TOOLS
    reasoning: ReasoningPlan | HarmonyPlan | None = None  # chat: split the thinking out (None: all content)


def _completion_lp(spec: ChoiceSpec, prefill: list[dict], tokens: list[dict], tops: list, prompt_len: int) -> dict:
    parts = []
    if spec.echo:
        parts.append(fmt.completion_logprobs(prefill, fmt.prefill_tops(prefill), 0))
    parts.append(fmt.completion_logprobs(tokens, tops, prompt_len if spec.echo else 0))
    return fmt.merge_completion_logprobs(parts)


def completion_choice(spec: ChoiceSpec, body: dict) -> dict:
    """A `/v1/completions` choice from a worker's `/generate` body."""
    details = body.get("details") or {}
    text = body.get("generated_text", "")
    prompt = spec.prompt_text if spec.prompt_text is not None else body.get("input_text", "")
    logprobs = None
    if spec.top is not None:
        tokens = details.get("tokens") or []
        tops = details.get("top_tokens") or [None] * len(tokens)
        logprobs = _completion_lp(spec, details.get("prefill") or [], tokens, tops, len(prompt))
    return _with_stop_reason(fmt.completion_choice(spec.index, prompt + text if spec.echo else text,
                                                   fmt.finish_reason(details) or "stop", logprobs), details)


def _with_stop_reason(choice: dict, details: dict) -> dict:
    """vLLM's `stop_reason` (the stop string matched, or the stop token id), when one ended it."""
    if details.get("stop_reason") is not None:
        choice["stop_reason"] = details["stop_reason"]
    return choice


def chat_choice(spec: ChoiceSpec, body: dict) -> dict:
    """A `/v1/chat/completions` choice from a worker's `/generate` body (tool calls parsed)."""
    details = body.get("details") or {}
    text = body.get("generated_text", "")
    finish = fmt.finish_reason(details) or "stop"
    logprobs = None
    if spec.top is not None:
        tokens = details.get("tokens") or []
        logprobs = fmt.chat_logprob_entries(tokens, details.get("top_tokens") or [None] * len(tokens))
    if isinstance(spec.reasoning, HarmonyPlan):
        return _harmony_choice(spec, output_text(details.get("tokens"), text), finish, logprobs)
    reader = spec.tools.reader
    if reader is not None:
        text = output_text(details.get("tokens"), text, reader.markers)
    reasoning, content = split_reasoning(spec.reasoning, text)
    calls = None
    if reader is not None:  # `auto` / `required`: the model's own format (server/protocol/tool_parsers/)
        answer = split_tool_calls(reader, spec.tools.names, content or "")
        content = answer.content if answer.calls else content
        calls = [{"name": n, "arguments": a} for n, a in answer.calls]
    elif spec.tools.mode == NAMED and finish == "stop":
        calls = spec.tools.calls(content or "")
        content = None if calls else content
    if calls:
        choice = fmt.chat_choice(spec.index, content, "tool_calls" if finish != "length" else finish, logprobs,
                                 tool_calls_message(calls))
    else:
        choice = fmt.chat_choice(spec.index, content, finish, logprobs)
    if spec.reasoning is not None:
        choice["message"]["reasoning_content"] = reasoning
    return _with_stop_reason(choice, details)


def _harmony_choice(spec: ChoiceSpec, text: str, finish: str, logprobs: list[dict] | None) -> dict:
    answer = split_harmony(spec.reasoning, text)
    calls = [{"name": n, "arguments": a} for n, a in answer.calls] if spec.tools.mode == AUTO else []
    finish = "tool_calls" if calls and finish != "length" else finish
    choice = fmt.chat_choice(spec.index, answer.content, finish, logprobs, tool_calls_message(calls))
    choice["message"]["reasoning_content"] = answer.reasoning
    return choice


class ChoiceStream:
    """One streamed choice: worker events in, OpenAI choice deltas out.

    Every choice has its own `index`; chat choices start with a `role` delta; a completion's
    echo (text and prompt logprobs) comes with its first event; a token's logprob entry rides on
    the next delta that goes out (after a held-back half character, an EOS), so none is lost.
    Tool calls stream as OpenAI's deltas: a named function's arguments token by token from the
    first event; `required` and `auto` output is read in the model's own format
    (server/protocol/tool_parsers/): a call goes out as its id and name once the name is read,
    then its arguments as they are written, and text that cannot be a call is released as
    content the moment it cannot be. Harmony's calls stream the same way."""

    def __init__(self, spec: ChoiceSpec, chat: bool):
        self.spec, self.chat = spec, chat
        self.started = self.done = False
        self.prompt_tokens = self.completion_tokens = 0
        self._offset = 0  # completions: where the next token starts in the choice's text
        self._pending: list = []  # logprob entries not sent yet (chat items, or completion parts)
        harmony = chat and isinstance(spec.reasoning, HarmonyPlan)
        self._harmony = HarmonySplitter(spec.reasoning) if harmony else None
        reader = spec.tools.reader if chat and not harmony else None
        self._tools = ToolCallSplitter(reader, spec.tools.names) if reader is not None else None
        self._keep = TAGS if harmony else (reader.markers if reader is not None else ())  # special tokens read
        self._call_id = call_id() if spec.tools.mode == NAMED else None
        thinking = chat and not harmony and spec.reasoning is not None
        self._thinking = ReasoningSplitter(spec.reasoning) if thinking else None
        self._called = False  # a tool call went out (harmony, or the model's own format)

    # -- deltas -------------------------------------------------------------------------
    def _logprobs(self):
        if self.spec.top is None:
            return None
        pending, self._pending = self._pending, []
        if self.chat:
            return {"content": pending, "refusal": None}
        return fmt.merge_completion_logprobs(pending) if pending else None

    def _delta(self, delta: dict | str, finish: str | None = None) -> dict:
        if self.chat:
            return {"index": self.spec.index, "delta": delta, "finish_reason": finish, "logprobs": self._logprobs()}
        return {"index": self.spec.index, "text": delta, "finish_reason": finish, "logprobs": self._logprobs()}

    def _record(self, token: dict, top: list | None) -> None:
        if self.spec.top is None:
            return
        if self.chat:
            self._pending.extend(fmt.chat_logprob_entries([token], [top]))
        else:
            self._pending.append(fmt.completion_logprobs([token], [top], self._offset))

    def _start(self, event: dict) -> list[dict]:
        self.started = True
        if self.chat:
            if self._call_id is not None:
                call = {"index": 0, "id": self._call_id, "type": "function",
                        "function": {"name": self.spec.tools.name, "arguments": ""}}
                return [self._delta({"role": "assistant", "content": None, "tool_calls": [call]})]
            return [self._delta({"role": "assistant", "content": ""})]
        if not self.spec.echo:
            return []
        prompt = self.spec.prompt_text if self.spec.prompt_text is not None else event.get("input_text", "")
        if self.spec.top is not None:
            prefill = event.get("prefill") or []
            self._pending.append(fmt.completion_logprobs(prefill, fmt.prefill_tops(prefill), 0))
        self._offset = len(prompt)
        return [self._delta(prompt)]

    def _text(self, piece: str) -> list[dict]:
        if not self.chat:
            self._offset += len(piece)
            return [self._delta(piece)]
        if self._call_id is not None:
            return [self._delta({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})]
        if self._harmony is not None:
            return self._parts(self._harmony.feed(piece))
        if self._thinking is None:
            return self._content(piece)
        return self._thought(*self._thinking.feed(piece))

    def _parts(self, parts: list[Part]) -> list[dict]:
        """Harmony or tool-call parts as deltas; tool calls only where the request's tools are
        `auto` or `required`."""
        out = []
        for p in parts:
            if p.kind == REASONING:
                out.append(self._delta({"reasoning_content": p.text}))
            elif p.kind == CONTENT:
                out.append(self._delta({"content": p.text}))
            elif self.spec.tools.mode not in (AUTO, REQUIRED):
                continue
            elif p.kind == TOOL_CALL:
                self._called = True
                call = {"index": p.call, "id": call_id(), "type": "function",
                        "function": {"name": p.text, "arguments": ""}}
                out.append(self._delta({"tool_calls": [call]}))
            elif p.kind == ARGUMENTS:
                out.append(self._delta({"tool_calls": [{"index": p.call, "function": {"arguments": p.text}}]}))
        return out

    def _thought(self, reasoning: str, content: str) -> list[dict]:
        """A reasoning delta, then the answer's text (either may be empty)."""
        out = [self._delta({"reasoning_content": reasoning})] if reasoning else []
        return out + (self._content(content) if content else [])

    def _content(self, piece: str) -> list[dict]:
        if self._tools is not None:
            return self._parts(self._tools.feed(piece))
        return [self._delta({"content": piece})]

    def _finish(self, details: dict) -> list[dict]:
        self.done = True
        self.prompt_tokens = details.get("input_length") or 0
        self.completion_tokens = details.get("generated_tokens") or 0
        finish = fmt.finish_reason(details) or "stop"
        out = self._thought(*self._thinking.finish()) if self._thinking is not None else []
        if self._harmony is not None:
            out = self._parts(self._harmony.finish())
        if self._tools is not None:
            out += self._parts(self._tools.finish())
        if self._called and finish != "length":
            finish = "tool_calls"
        if self._call_id is not None and finish == "stop":
            finish = "tool_calls"
        out.append(_with_stop_reason(self._delta({} if self.chat else "", finish), details))
        return out

    # -- the one entry point ------------------------------------------------------------
    def on_event(self, event: dict) -> list[dict]:
        """The choice deltas one worker event produces (possibly none)."""
        out = [] if self.started else self._start(event)
        token = event.get("token")
        if token is not None:
            self._record(token, event.get("top_tokens"))
            text = token.get("text")
            if text and (not token.get("special") or text in self._keep):
                out += self._text(text)
        details = event.get("details")
        if details is not None or event.get("generated_text") is not None:
            out += self._finish(details or {})
        return out

    def whole(self, body: dict) -> list[dict]:
        """The deltas of a complete `/generate` body (prompt scoring, which is not streamed)."""
        details = body.get("details") or {}
        event = {"prefill": details.get("prefill"), "input_text": body.get("input_text")}
        return self._start(event) + self._finish(details)
