"""A request's grammar as llguidance reads it, without torch: shared by the worker and its
sandboxed compile children (workers/sampling/grammar_child.py).

Design: one function turns (kind, text, strict) into the llguidance grammar, so the child that
proves a grammar compiles within budget and the worker that then builds it build the very same
grammar. `LIMITS` are llguidance's defaults with `verbose_errors` off, so an error names the
problem without dumping the parser state and the grammar into the 422. Trade-off: llguidance's
limits bound lexer and parser work but not every path of a build, which is why the sandbox adds a
wall-clock and a memory bound of its own."""

from __future__ import annotations

import json

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model would spend its tokens on spaces
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
ENGINE_REASON_CHARS = 64  # characters of the engine's reason a refusal quotes (it may hold the client's grammar)


class GrammarError(ValueError):
    """A grammar the engine cannot compile (answered with HTTP 422, naming why)."""


def grammar_source(kind: str, text: str, strict: bool = True) -> str:
    """The llguidance grammar for a spec (`GrammarError` for a malformed one). `choice`: `text`
    is a JSON list of strings, the output exactly one of them."""
    try:
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            options = json.loads(text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        schema = '{"type": "object"}' if kind == "json_object" else text
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_OPTIONS, "lenient": not strict})
    except ValueError as e:  # UnicodeEncodeError included: a lone surrogate the router let through
        raise GrammarError(f"The {describe(kind)} cannot be enforced: {engine_reason(str(e))}") from None


def describe(kind: str) -> str:
    """How a refusal names the grammar: `json schema`, `json object`, `regex`, `choice`."""
    return kind.replace("_", " ")


def engine_reason(text: str) -> str:
    """The engine's reason as a refusal quotes it: its `error: ...` line (a regex parse error
    repeats the whole pattern around it) or else its first line, at most `ENGINE_REASON_CHARS`."""
    lines = [line.strip() for line in text.strip().splitlines()] or ["no reason given"]
    line = next((x.removeprefix("error: ") for x in lines if x.startswith("error: ")), lines[0])
    if len(line) > ENGINE_REASON_CHARS:
        line = f"{line[:ENGINE_REASON_CHARS]}... ({len(line)} characters)"
    return line.encode("utf-8", "backslashreplace").decode("utf-8")
