"""Structured chat output: `response_format` and `tools` -> a grammar for the worker, and the
model's text -> OpenAI `tool_calls`.

Design (vLLM's): a forced `tool_choice` (a named function, `required`) and `response_format`
become a grammar the worker enforces, so their output always parses and validates; `auto` stays
unconstrained and its output is read in the model's own format (server/protocol/tool_parsers/),
calls of listed tools becoming `tool_calls` and other text content. Trade-off: `auto` calls can
be malformed or missed, where a grammar would cost the model its own format. The chat template
receives `tools` (transformers' convention); a template that never mentions `tools` gets them as
a system message instead, and earlier assistant tool calls as JSON in their content, so the
model sees them either way.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from server.protocol.openai.requests import ChatCompletionRequest, NamedToolChoice
from server.protocol.tool_parsers.jsonscan import loads
from server.protocol.tool_parsers.splitter import split_tool_calls
from server.protocol.tool_parsers.syntax import GENERIC, ToolSyntax
from server.protocol.tool_parsers.syntax import REQUIRED as REQUIRED_SYNTAX

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: the mode, the tools' function objects, and for a
    named choice the function.

    - `none`: tools are shown to the model, the output is plain content;
    - `named`: the output is that function's arguments, enforced by its `parameters` schema; it
      becomes one tool call;
    - `required`: the output is a JSON array (one item, or several with `parallel`) of
      `{"name": <one of the tools>, "arguments": <its parameters>}`, enforced by an `anyOf` over
      the tools, and read as calls as it is written;
    - `auto` (the default with tools): unconstrained, read in `syntax` (chosen by
      server/protocol/tool_parsers/choose.py)."""

    mode: str
    functions: tuple[dict, ...] = ()
    name: str | None = None
    parallel: bool = True
    syntax: ToolSyntax | None = GENERIC  # how `auto` output is read (None: `--tool-call-parser none`)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["name"] for f in self.functions)

    @property
    def forced(self) -> bool:
        return self.mode in (REQUIRED, NAMED)

    @property
    def reader(self) -> ToolSyntax | None:
        """The format output is read as calls in (None: a named call, or no calls to read)."""
        if self.mode == REQUIRED:
            return REQUIRED_SYNTAX
        return self.syntax if self.mode == AUTO else None

    def grammar(self) -> dict | None:
        """The worker `grammar` a forced choice generates under (None otherwise)."""
        if self.mode == NAMED:
            f = next(f for f in self.functions if f["name"] == self.name)
            return {"type": "json", "value": f.get("parameters") or _EMPTY_PARAMETERS,
                    "strict": f.get("strict") is not False}
        if self.mode == REQUIRED:
            return {"type": "json", "value": required_schema(self.functions, self.parallel),
                    "strict": all(f.get("strict") is not False for f in self.functions)}
        return None

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls in the model's complete output, as `{"name", "arguments"}` (arguments
        as JSON text); None when the output is content (or a forced call cut short)."""
        if self.mode == NAMED:
            try:
                loads(text)  # nesting bounded: a model can be made to write a thousand brackets
            except ValueError:
                return None
            return [{"name": self.name, "arguments": text}]
        if self.reader is None:
            return None
        answer = split_tool_calls(self.reader, self.names, text)
        return [{"name": n, "arguments": a} for n, a in answer.calls] or None


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    functions = tuple(t.function.model_dump(exclude_none=True) for t in req.tools or ())
    choice = req.tool_choice if req.tool_choice is not None else (AUTO if functions else NONE)
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolPlan(NAMED, functions, choice.function.name, parallel)
    return ToolPlan(choice, functions, None, parallel)


def response_grammar(req: ChatCompletionRequest) -> dict | None:
    """The worker `grammar` for `response_format` (None for text): `json_object`, or `json` with
    the schema (`strict: false` lets the engine ignore keywords it does not implement instead of
    refusing the schema)."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"type": "json_object"}
    js = rf.json_schema
    return {"type": "json", "value": js.schema_, "strict": js.strict is not False}


def required_schema(functions: tuple[dict, ...], parallel: bool) -> dict:
    """A JSON array of calls of the listed functions, each with arguments matching its
    parameters. Each function's `$defs` move to the root so its `#/$defs/...` refs resolve."""
    defs: dict = {}
    items = []
    for f in functions:
        params = dict(f.get("parameters") or _EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            found = params.pop(key, None) or {}
            if not isinstance(found, dict):  # a list or a string here made `.items()` raise: a 500
                raise ValueError(f"`tools.function.parameters.{key}` of `{f['name']}` must be an object of named "
                                 f"schemas, got `{type(found).__name__}`")
            for name, sub in found.items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise ValueError(f"`tools` define `{key}/{name}` twice with different schemas; rename one")
        items.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def tool_prompt(functions: tuple[dict, ...]) -> str:
    """The system message for a template that does not take `tools`."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("You can call these functions:\n" + listed + '\nTo call one, answer with JSON: {"name": <function name>, '
            '"arguments": <an object matching its parameters>}.')


def template_messages(req: ChatCompletionRequest, native_tools: bool) -> list[dict]:
    """Messages as chat templates expect them: role and text content, plus `tool_calls` on
    assistant turns (arguments as objects) and `tool_call_id` on tool results."""
    out = []
    for m in req.messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _loads(c.function.arguments) or {}}}
                     for c in m.tool_calls]
            if native_tools:
                d["tool_calls"] = calls
            else:
                shown = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) for c in calls)
                d["content"] = f"{d['content']}\n{shown}".strip()
        out.append(d)
    plan = plan_tools(req)
    if plan.functions and not native_tools:
        out.insert(0, {"role": "system", "content": tool_prompt(plan.functions)})
    return out


def tool_calls_message(calls: list[dict]) -> list[dict]:
    """OpenAI `message.tool_calls` for parsed calls."""
    return [{"id": call_id(), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]
