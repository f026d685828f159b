"""`--reasoning-parser`: how the router splits a reasoning model's thinking from its answer.

`auto` (default) picks the parser from the model: harmony for gpt-oss (config.json
`model_type` `gpt_oss`, or a chat template that writes harmony's `<|channel|>`); qwen3 when
the chat template writes `<think>` or the family thinks in `<think>` tags (Qwen3, SmolLM3).
`qwen3` and `harmony` force that parser on any model; `none` turns parsing off, so `content`
holds the output as generated, tags and all (vLLM's `--reasoning-parser`, where leaving the flag out
means none; here `auto` is the default because a wrong guess costs little: the parser only
acts on output that opens a `<think>` block or follows a prompt that opened one).
"""

from __future__ import annotations

import argparse

from server.errors import UsageError

AUTO, QWEN3, NONE, HARMONY = "auto", "qwen3", "none", "harmony"
REASONING_PARSERS = (AUTO, QWEN3, NONE, HARMONY)


def add_reasoning_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("chat", "how chat output is parsed")
    g.add_argument("--reasoning-parser", default=None, metavar="|".join(REASONING_PARSERS),
                   help="split the model's thinking into `reasoning_content`: qwen3 (`<think>...</think>`) or harmony "
                        "(gpt-oss's channels, and its tool calls) forces that parser, none turns parsing off, auto "
                        "(default) decides from the chat template and the model family")


def reasoning_parser_from_args(args) -> str:
    """The `--reasoning-parser` value (`UsageError` names a bad one); `auto` when not given."""
    value = getattr(args, "reasoning_parser", None)
    if value is None:
        return AUTO
    if value not in REASONING_PARSERS:
        raise UsageError(f"`--reasoning-parser {value}` is not a parser. Accepted: {', '.join(REASONING_PARSERS)}")
    return value
