"""Harmony, gpt-oss's chat format: the messages a gpt-oss model writes -> `reasoning_content`,
`content` and OpenAI `tool_calls` (what vLLM answers for gpt-oss; the rules: docs/serving.md).

Design: one small state machine, `HarmonySplitter`, fed the output piece by piece as
`ReasoningSplitter` is (server/protocol/reasoning.py): a stream feeds it each token's text, a
whole answer the whole text, so a stream's deltas always concatenate to the whole answer's
fields. It gives out `Part`s in order and holds back only a header (until `<|message|>`) and
what may still become a tag. Trade-off: tags are matched as text, not as token ids (vLLM parses
ids with openai-harmony); gpt-oss's tokenizer marks them special, and the worker streams a
special token's text flagged `special` and leaves it out of `generated_text`, so the router
reads them from the token events (`output_text`) and no worker setting changes; the text of
ordinary tokens that happen to spell a tag is taken as that tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
TAGS = (START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN)
FUNCTIONS = "functions."  # the namespace of the request's tools in a recipient

# what a Part carries
REASONING, CONTENT, TOOL_CALL, ARGUMENTS = "reasoning", "content", "tool_call", "arguments"
_DROP = "drop"  # a message whose body goes nowhere

_TAG = re.compile("|".join(re.escape(t) for t in TAGS))
_LONGEST = max(len(t) for t in TAGS)
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_HEADER, _BODY, _DONE = "header", "body", "done"


@dataclass(frozen=True)
class HarmonyPlan:
    """How one request's output is read: the header the prompt left open (the text after its
    last `<|start|>`, `assistant` for gpt-oss's generation prompt)."""

    header: str = "assistant"


@dataclass(frozen=True)
class Part:
    """A piece of output: reasoning or content text, a tool call's start (`text` is its name)
    or its argument text; `call` numbers the calls of one output from 0."""

    kind: str
    text: str
    call: int = -1


@dataclass(frozen=True)
class HarmonyAnswer:
    """A whole output's fields (None where empty) and its tool calls as (name, arguments)."""

    reasoning: str | None
    content: str | None
    calls: tuple[tuple[str, str], ...]


def plan_harmony(prompt: str, constrained: bool = False) -> HarmonyPlan | None:
    """The plan for one rendered prompt; None when a grammar constrains the output (the worker
    enforces it from the first token, so the output is the constrained text, no headers)."""
    if constrained:
        return None
    at = prompt.rfind(START)
    return HarmonyPlan(prompt[at + len(START):] if at >= 0 else "")


def output_text(tokens: list[dict] | None, fallback: str, keep: tuple[str, ...] = TAGS) -> str:
    """A whole answer's text with the special tokens in `keep` in it (harmony's tags, a tool-call
    format's markers), from the worker's token entries (a special token's text is not in
    `generated_text`); `fallback` when no such token is there."""
    if not tokens or not any(t.get("special") and t.get("text") in keep for t in tokens):
        return fallback
    return "".join(t.get("text") or "" for t in tokens if not t.get("special") or t.get("text") in keep)


def _partial_tail(text: str) -> int:
    """Length of the longest end of `text` that is the start of a tag (what may still become one)."""
    at = text.rfind("<", max(0, len(text) - _LONGEST + 1))
    while at >= 0:
        tail = text[at:]
        if any(t.startswith(tail) for t in TAGS):
            return len(tail)
        at = text.rfind("<", max(0, len(text) - _LONGEST + 1), at)
    return 0


def _may_be_header(text: str) -> bool:
    """Output text at the start of a message that may still be its header's recipient
    (`<|start|>assistant to=functions.f<|channel|>...`): blank, or ` to=...` begun."""
    s = text.lstrip()
    return "to=".startswith(s) or s.startswith("to=")


def _read_header(header: str) -> tuple[str, str | None, str | None]:
    """(role, channel, recipient) of a header's text, tags included; "" / None where absent."""
    words = header.split("<|", 1)[0].split()
    role = words[0] if words and not words[0].startswith("to=") else ""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return role, channel.group(1) if channel else None, recipient.group(1) if recipient else None


class HarmonySplitter:
    """Output text in, `Part`s out.

    The model answers in messages: `<|channel|>analysis<|message|>...<|end|>` (its thinking),
    then `<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer), or a tool
    call `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {...}<|call|>` (the recipient may stand after the role instead). A message's header (role,
    channel, recipient, content type) decides where its body goes:
    - recipient `functions.NAME` -> a tool call of NAME, the body its arguments (any channel);
    - channel `analysis`, or another recipient (a built-in tool: `python`, `browser.search`) ->
      reasoning;
    - channel `final` or `commentary` (a preamble), no channel, any other channel -> content;
    - a header whose role is not the assistant's (a tool's answer the model wrote) -> dropped.
    Several messages of one kind are joined with a newline, as vLLM joins them; headers and the
    tags never reach a field; `<|return|>` and `<|call|>` (gpt-oss's EOS tokens) end the output.

    The prompt's text after its last `<|start|>` (`HarmonyPlan.header`) is fed first and its
    parts discarded; a template that opened a message starts the output inside it. Output with
    no header at all is content, given out as soon as it cannot be a header any more. Output cut
    by the length limit gives what it had (a tool call's arguments as far as they went); a
    header cut before `<|message|>` gives nothing."""

    def __init__(self, plan: HarmonyPlan):
        self._state, self._header = _HEADER, ""
        self._kind, self._call, self._calls = _DROP, -1, 0
        self._said: set[str] = set()  # kinds that gave out text (the next message of one is joined by "\n")
        self._fresh = False  # the open message gave out nothing yet
        self._opening = False  # the output's first header, which may turn out to be plain text
        self._held = plan.header
        self._advance(final=False)  # the prompt's open header: its parts are the prompt's, not output
        self._opening = self._state == _HEADER and _TAG.search(self._header) is None
        self._lead = len(self._header)  # where the output's own text starts in that header
        self._held = ""  # (a tag's beginning at the prompt's very end stays the prompt's)
        self._said.clear()

    @property
    def calls(self) -> int:
        """Tool calls begun so far."""
        return self._calls

    def feed(self, piece: str) -> list[Part]:
        """The parts that `piece` lets out (possibly none)."""
        self._held += piece
        return self._advance(final=False)

    def finish(self) -> list[Part]:
        """What was held back, at the end of the output."""
        out = self._advance(final=True)
        if self._state == _HEADER and self._opening:  # plain output too short to tell (`t`)
            text = self._header[self._lead:]
            if text.strip() and not text.lstrip().startswith("to="):
                self._begin(CONTENT)
                self._emit(text, out)
        self._state = _DONE
        return out

    # -- the machine ----------------------------------------------------------------------
    def _advance(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while self._held and self._state != _DONE:
            found = _TAG.search(self._held)
            if found is None:
                keep = 0 if final else _partial_tail(self._held)
                text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                self._text(text, out)
                break
            text, tag, self._held = self._held[: found.start()], found.group(), self._held[found.end():]
            self._text(text, out)
            self._tag(tag, out)
        if self._state == _DONE:
            self._held = ""
        return out

    def _text(self, text: str, out: list[Part]) -> None:
        if not text:
            return
        if self._state == _BODY:
            self._emit(text, out)
            return
        self._header += text
        if self._opening and not _may_be_header(self._header[self._lead:]):  # no header: plain content
            text, self._header = self._header[self._lead:], ""
            self._begin(CONTENT)
            self._emit(text, out)

    def _tag(self, tag: str, out: list[Part]) -> None:
        self._opening = False
        if self._state == _HEADER:
            if tag == MESSAGE:
                self._open(out)
            elif tag in (START, END):  # a new message; a header without a body gives nothing
                self._header = ""
            elif tag in (RETURN, CALL):
                self._state = _DONE
            else:  # `<|channel|>`, `<|constrain|>`: part of the header
                self._header += tag
            return
        if tag in (MESSAGE, CONSTRAIN):  # no place inside a body: dropped, never content
            return
        self._state, self._header = _HEADER, CHANNEL if tag == CHANNEL else ""  # the message ends
        if tag in (RETURN, CALL):
            self._state = _DONE

    def _open(self, out: list[Part]) -> None:
        """`<|message|>` closes the header: where the body goes."""
        role, channel, recipient = _read_header(self._header)
        self._header = ""
        if role not in ("", "assistant"):
            self._begin(_DROP)
        elif recipient is not None and recipient.startswith(FUNCTIONS):
            self._begin(ARGUMENTS)
            self._call, self._calls = self._calls, self._calls + 1
            out.append(Part(TOOL_CALL, recipient[len(FUNCTIONS):], self._call))
        elif recipient is not None or channel == "analysis":
            self._begin(REASONING)
        else:
            self._begin(CONTENT)

    def _begin(self, kind: str) -> None:
        self._state, self._kind, self._fresh = _BODY, kind, True

    def _emit(self, text: str, out: list[Part]) -> None:
        if not text or self._kind == _DROP:
            return
        if self._fresh and self._kind in self._said and self._kind != ARGUMENTS:  # each call has its own
            text = "\n" + text
        self._fresh = False
        self._said.add(self._kind)
        out.append(Part(self._kind, text, self._call if self._kind == ARGUMENTS else -1))


def gather(parts: list[Part]) -> HarmonyAnswer:
    """The fields of a whole output from all its parts."""
    reasoning, content, calls = [], [], []
    for p in parts:
        if p.kind == REASONING:
            reasoning.append(p.text)
        elif p.kind == CONTENT:
            content.append(p.text)
        elif p.kind == TOOL_CALL:
            calls.append([p.text, ""])
        elif p.kind == ARGUMENTS:
            calls[p.call][1] += p.text
    return HarmonyAnswer("".join(reasoning) or None, "".join(content) or None, tuple((n, a) for n, a in calls))


def split_harmony(plan: HarmonyPlan, text: str) -> HarmonyAnswer:
    """The fields of a whole output."""
    splitter = HarmonySplitter(plan)
    return gather(splitter.feed(text) + splitter.finish())
