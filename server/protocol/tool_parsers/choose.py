"""Which tool-call format a model writes: `--tool-call-parser`, else its chat template.

A chat template shows the model its tools and how to call them, so it names the format the
model was trained on: the tag it renders earlier calls with (`<tool_call>`, `[TOOL_CALLS]`,
`<|python_tag|>`), or the instruction it gives (`"parameters": dictionary of argument name`,
Llama 3's; `[func_name1(params_name1=...` the pythonic one's). gpt-oss (harmony) has its own
reader (server/protocol/harmony.py): `openai` here says so and the chat route reads harmony.
A template that says nothing gets the generic reader, which accepts the common formats; the
trade-off is a model that writes a bare JSON object as its answer with tools present, which
the generic and Llama readers take for a call when it names a listed tool (vLLM's too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from server.config.protocol import TOOL_CALL_PARSERS
from server.protocol.tool_parsers.syntax import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PYTHONIC,
    SYNTAXES,
    ToolSyntax,
)

logger = logging.getLogger(__name__)

HARMONY_PARSER = "openai"  # vLLM's name for gpt-oss's format
HARMONY_FAMILIES = ("gpt_oss",)
# (what the template holds, the format it means), in the order they are tried
_TEMPLATE_SIGNS: tuple[tuple[str, ToolSyntax], ...] = (
    ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL),
    ("<|python_tag|>", LLAMA3_JSON),
    ("[func_name1(", PYTHONIC),
    ('"parameters": dictionary of argument name', LLAMA3_JSON),
)


@dataclass(frozen=True)
class ToolParserChoice:
    """The format a model's calls are read in (None: harmony, or no parsing) and why."""

    syntax: ToolSyntax | None
    harmony: bool
    reason: str

    @property
    def name(self) -> str:
        return HARMONY_PARSER if self.harmony else (self.syntax.name if self.syntax else "none")


@lru_cache(maxsize=16)
def choose_tool_parser(flag: str, template: str, model_type: str | None) -> ToolParserChoice:
    """The reader for `--tool-call-parser flag` with this chat template and config.json `model_type`."""
    if flag not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool-call parser `{flag}`. Accepted: {', '.join(TOOL_CALL_PARSERS)}")
    if flag == "none":
        choice = ToolParserChoice(None, False, "--tool-call-parser none")
    elif flag == HARMONY_PARSER:
        choice = ToolParserChoice(None, True, "--tool-call-parser openai")
    elif flag != "auto":
        choice = ToolParserChoice(SYNTAXES[flag], False, f"--tool-call-parser {flag}")
    elif (model_type or "").startswith(HARMONY_FAMILIES) or "<|channel|>" in template:
        choice = ToolParserChoice(None, True, "the model writes harmony (gpt-oss)")
    else:
        sign = next(((text, syntax) for text, syntax in _TEMPLATE_SIGNS if text in template), None)
        if sign is not None:
            choice = ToolParserChoice(sign[1], False, f"the chat template writes `{sign[0]}`")
        else:
            choice = ToolParserChoice(GENERIC, False, "the chat template names no format: the common ones are read")
    logger.info("tool-call parser: %s (%s)", choice.name, choice.reason)
    return choice
