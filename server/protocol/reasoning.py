"""Reasoning parsers: a thinking model's `<think>...</think>` text -> `reasoning_content`, the
rest -> `content` (what vLLM's `--reasoning-parser qwen3` returns; the rules: docs/serving.md).

Design: one parser, `ReasoningSplitter`, a small state machine fed the output piece by piece: a
stream feeds it each token's text, a whole answer the whole text (`split_reasoning`), so a
stream's deltas always concatenate to the non-streamed fields; it holds back only what may still
turn out to be a tag, or the newlines the split drops. Where the reasoning starts comes from the
rendered prompt (`plan_reasoning`). gpt-oss writes harmony instead (channels, not tags):
`choose_parser` picks it and `plan_reasoning` hands such a prompt to server/protocol/harmony.py.
Trade-off: the tags are matched as text, not as token ids (vLLM matches ids), so a tag that a
tokenizer marks special, and that the worker therefore leaves out of the text, is not seen;
Qwen3's and SmolLM3's tokenizers keep `<think>` and `</think>` as ordinary added tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from server.config.reasoning import AUTO, HARMONY, NONE, QWEN3, REASONING_PARSERS
from server.protocol.harmony import CHANNEL, END, HarmonyPlan, plan_harmony

logger = logging.getLogger(__name__)

# config.json `model_type`s (prefixes) of the families that think in `<think>` tags
THINKING_FAMILIES = ("qwen3", "smollm3")
HARMONY_FAMILIES = ("gpt_oss",)  # ... and of those that write harmony


@dataclass(frozen=True)
class ReasoningSyntax:
    """The tags one parser looks for."""

    name: str
    start: str
    end: str


# harmony's start and end are those of a message's channel header and of the message
_SYNTAX = {QWEN3: ReasoningSyntax(QWEN3, "<think>", "</think>"), HARMONY: ReasoningSyntax(HARMONY, CHANNEL, END)}
assert set(_SYNTAX) | {AUTO, NONE} == set(REASONING_PARSERS)


@dataclass(frozen=True)
class ParserChoice:
    """The parser a model gets (None: no parsing) and why."""

    syntax: ReasoningSyntax | None
    reason: str


@lru_cache(maxsize=16)
def choose_parser(flag: str, template: str, model_type: str | None) -> ParserChoice:
    """The parser for `--reasoning-parser flag` with this chat template and config.json
    `model_type` (logged once per model)."""
    if flag not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser `{flag}`. Accepted: {', '.join(REASONING_PARSERS)}")
    syntax, harmony = _SYNTAX[QWEN3], _SYNTAX[HARMONY]
    if flag == NONE:
        choice = ParserChoice(None, "--reasoning-parser none")
    elif flag in (QWEN3, HARMONY):
        choice = ParserChoice(_SYNTAX[flag], f"--reasoning-parser {flag}")
    elif model_type and model_type.startswith(HARMONY_FAMILIES):
        choice = ParserChoice(harmony, f"the model family `{model_type}` writes harmony")
    elif harmony.start in template:
        choice = ParserChoice(harmony, f"the chat template writes harmony's `{harmony.start}`")
    elif syntax.start in template:
        choice = ParserChoice(syntax, f"the chat template writes `{syntax.start}`")
    elif model_type and model_type.startswith(THINKING_FAMILIES):
        choice = ParserChoice(syntax, f"the model family `{model_type}` thinks in `{syntax.start}` tags")
    else:
        choice = ParserChoice(None, "neither the chat template nor the model family uses reasoning tags")
    logger.info("reasoning parser: %s (%s)", choice.syntax.name if choice.syntax else "none", choice.reason)
    return choice


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is split: the tags, and whether the prompt opened the block."""

    syntax: ReasoningSyntax
    opened: bool


def plan_reasoning(choice: ParserChoice, prompt: str, template_kwargs: dict | None = None,
                   constrained: bool = False) -> ReasoningPlan | HarmonyPlan | None:
    """The split for one rendered prompt (None: the output is all content), as vLLM's
    `prompt_is_reasoning_end` decides it:

    - a prompt that ends with `<think>` (Qwen3-2507 Thinking and Qwen3.5 templates) opened the
      block: the output is reasoning until `</think>` (a repeated `<think>` first is dropped);
    - a prompt that ends with `</think>` (Qwen3 with `enable_thinking` false, SmolLM3's
      `/no_think`) closed it: no parsing, the output is the answer;
    - otherwise the output opens the block itself when it begins with `<think>` (Qwen3 before
      2507, SmolLM3); output that does not is all content, so an instruct model whose template
      merely mentions `<think>` answers as without a parser.

    `enable_thinking` false turns parsing off whatever the output holds, and so does a grammar
    (`constrained`: the worker enforces it from the first token, so that output has no reasoning
    part; vLLM starts the grammar after `</think>`). Harmony ignores `enable_thinking`: gpt-oss
    always writes its analysis channel."""
    syntax = choice.syntax
    if syntax is not None and syntax.name == HARMONY:
        return plan_harmony(prompt, constrained)
    if syntax is None or constrained or (template_kwargs or {}).get("enable_thinking") is False:
        return None
    tail = prompt.rstrip()
    if tail.endswith(syntax.end):
        return None
    return ReasoningPlan(syntax, opened=tail.endswith(syntax.start))


def add_reasoning(messages: list[dict], reasoning: list[str | None]) -> list[dict]:
    """Put each earlier turn's reasoning into its template message as `reasoning_content` (the
    name chat templates read). `reasoning` has one entry per request message; `messages` may
    have more at the front (a system message listing tools), so both align at their ends."""
    start = len(messages) - len(reasoning)
    assert start >= 0, "template messages are the request's messages, possibly behind a system message"
    for message, text in zip(messages[start:], reasoning, strict=True):
        if text:
            message["reasoning_content"] = text
    return messages


_OPENING, _REASONING, _AFTER, _CONTENT = "opening", "reasoning", "after", "content"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (what may still become it)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Output text in, (reasoning, content) pieces out.

    No `</think>` before the end: the output stopped inside its reasoning (usually `length`), so
    it is all reasoning and `content` is null, streamed or not, as vLLM's Qwen3 parser answers
    while thinking is on (vLLM's older rule, all content, would contradict the reasoning deltas a
    stream has already sent). The newlines just inside the tags and just after `</think>` are
    dropped, as the Qwen3 and SmolLM3 templates drop them when they render `reasoning_content`
    back into a prompt: a turn round-trips and `content` does not start with blank lines."""

    def __init__(self, plan: ReasoningPlan):
        self.syntax = plan.syntax
        self._fallback = _REASONING if plan.opened else _CONTENT  # what output without `<think>` is
        self._phase = _OPENING
        self._held = ""  # text received and not given out yet
        self._lead = True  # no reasoning given out yet (its leading newlines are dropped)
        self.entered = False  # the output had a reasoning part

    def feed(self, piece: str) -> tuple[str, str]:
        """The reasoning and content that `piece` lets out (either may be empty)."""
        self._held += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            before = (self._phase, self._held)
            if self._phase == _OPENING:
                self._opening(final)
            if self._phase == _REASONING:
                reasoning.append(self._reasoning(final))
            if self._phase == _AFTER:
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._phase = _CONTENT
            if self._phase == _CONTENT:
                content.append(self._held)
                self._held = ""
            if (self._phase, self._held) == before:
                return "".join(reasoning), "".join(content)

    def _opening(self, final: bool) -> None:
        """Wait while the output may still begin with the start tag; then enter the block or fall back."""
        start = self.syntax.start
        body = self._held.lstrip()
        if body.startswith(start):
            self._phase, self._held, self.entered = _REASONING, body[len(start):], True
        elif final or not start.startswith(body):  # `body` is no longer a beginning of the tag
            self._phase = self._fallback
            self.entered = self._fallback == _REASONING

    def _reasoning(self, final: bool) -> str:
        """The reasoning that can go out now; moves on to `_AFTER` at the end tag."""
        end = self.syntax.end
        if self._lead:
            self._held = self._held.lstrip("\n")
        at = self._held.find(end)
        if at >= 0:
            out, self._held, self._phase = self._held[:at].rstrip("\n"), self._held[at + len(end):], _AFTER
        elif final:
            out, self._held = self._held.rstrip("\n"), ""
        else:
            safe = self._held[: len(self._held) - _partial_tail(self._held, end)].rstrip("\n")
            out, self._held = safe, self._held[len(safe):]
        self._lead = self._lead and not out
        return out


def split_reasoning(plan: ReasoningPlan | None, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; without a plan, (None, text). Once the
    output had a reasoning part, an empty field is None (OpenAI's null)."""
    if plan is None:
        return None, text
    splitter = ReasoningSplitter(plan)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    if not splitter.entered:
        return None, c1 + c2
    return (r1 + r2) or None, (c1 + c2) or None
