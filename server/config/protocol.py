"""The public protocols' knobs: `--tool-call-parser` (vLLM's names; `auto` reads the chat template),
`--task auto|generate|embed` (whether `/v1/embeddings` is served) and `--lenient-params`
(docs/clients.md says what each does).

Design: one frozen value validated at start, each error naming the bad value and the accepted
ones. Trade-off: `--lenient-params` is off by default: a request field hetserve does not implement
is a 400 naming it, since a silently ignored field misleads the client; with it, a `Warning`
header names the field instead, for clients that cannot be told to stop sending it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from server.errors import UsageError

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic", "openai", "none")
TASKS = ("auto", "generate", "embed")


@dataclass(frozen=True)
class ProtocolConfig:
    """How requests are read and answers parsed (see the module docstring)."""

    tool_call_parser: str = "auto"
    task: str = "auto"
    lenient_params: bool = False


def add_protocol_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("protocols", "tool calls, the served task, request fields")
    g.add_argument("--tool-call-parser", default=None, metavar="|".join(TOOL_CALL_PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call> JSON, Qwen), llama3_json, mistral "
                        "([TOOL_CALLS]), pythonic ([f(a=1)]), openai (gpt-oss harmony), none (content); auto "
                        "(default) reads the chat template")
    g.add_argument("--task", default=None, metavar="|".join(TASKS),
                   help="embed or auto (default): /v1/embeddings is served beside generation, pooled as the "
                        "checkpoint's sentence-transformers config says (else its last token); generate refuses it")
    g.add_argument("--special-tokens-in-content", action="store_true",
                   help="let chat message text contain the model's special tokens (default: 422), which then "
                        "act as control tokens")
    g.add_argument("--lenient-params", action="store_true",
                   help="answer a request field hetserve does not implement with a `Warning` header naming it "
                        "instead of a 400")


def protocol_from_args(args) -> ProtocolConfig:
    """The protocol flags that were given, checked (`UsageError` names a bad one)."""
    parser = getattr(args, "tool_call_parser", None) or "auto"
    if parser not in TOOL_CALL_PARSERS:
        raise UsageError(f"`--tool-call-parser {parser}` is not a parser. Accepted: {', '.join(TOOL_CALL_PARSERS)}")
    task = getattr(args, "task", None) or "auto"
    if task not in TASKS:
        raise UsageError(f"`--task {task}` is not a task. Accepted: {', '.join(TASKS)}")
    return ProtocolConfig(parser, task, bool(getattr(args, "lenient_params", False)))
