"""Chat messages -> prompt text through the model's own chat template (jinja2, no torch).

The template comes from the model directory through the same lookup the worker uses
(`workers.contract.find_chat_template`: `chat_template.jinja`, else
`tokenizer_config.json["chat_template"]`); else the template the worker reported in
`/capability` (a router that cannot read the worker's directory); else a plain ChatML
template, with a warning, so a model without a template still answers. Rendering mirrors `transformers`' `apply_chat_template`: a sandboxed jinja2
environment with `trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now` and a
`tojson` filter, and the variables `messages`, `bos_token`, `eos_token`,
`add_generation_prompt`. A template that raises (say, roles that do not alternate) becomes
a `ChatTemplateError` naming the problem (422 at the HTTP edge).

Special tokens in content: the worker tokenizes the rendered prompt with special tokens
parsed, so a user typing `<|im_start|>system` inside a message would get the real control
token and could forge a turn. By default a message whose content or name contains the text
of one of the model's special tokens (`read_special_tokens`) is refused with a 422 naming
the token, as tiktoken refuses disallowed special tokens; `--special-tokens-in-content`
lets them through (a trusted client that writes control tokens on purpose).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.contract import (
    ModelDescription,
    find_chat_template,
    read_special_tokens,
    read_tokenizer_config,
    token_text,
)

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages or could not be compiled."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str | None
    eos_token: str | None
    origin: str  # where the template came from (shown in logs)
    forbidden_tokens: tuple[str, ...] = ()  # special tokens refused inside message text

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        self.check_content(messages)
        try:
            template = _compile(self.source)
            return template.render(messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                   add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"The chat template refused the messages: {e}") from e


    def check_content(self, messages: list[dict]) -> None:
        """`ChatTemplateError` (422) when a message's text holds a forbidden special token."""
        if not self.forbidden_tokens:
            return
        for i, m in enumerate(messages):
            for field in ("content", "name"):
                text = m.get(field)
                if not isinstance(text, str) or not text:
                    continue
                for token in self.forbidden_tokens:
                    if token in text:
                        raise ChatTemplateError(
                            f"`messages.{i}.{field}` contains the special token `{token}`, which would act as a "
                            "control token. Accepted: text without the model's special tokens (or start the "
                            "server with --special-tokens-in-content)")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"The chat template does not compile: {e}") from e


def load_chat_template(model_dir: Path | None, reported: ModelDescription | dict | None = None,
                       special_tokens_in_content: bool = False) -> ChatTemplate:
    """The model's chat template (see the module docstring for the order of sources);
    `reported` is the `model` object of a worker's `/capability`."""
    found_template = _load_template(model_dir, ModelDescription.model_validate(reported or {}))
    if special_tokens_in_content:
        return found_template
    forbidden = read_special_tokens(model_dir) or tuple(
        t for t in (found_template.bos_token, found_template.eos_token) if t)
    return replace(found_template, forbidden_tokens=forbidden)


def _load_template(model_dir: Path | None, reported: ModelDescription) -> ChatTemplate:
    config = read_tokenizer_config(model_dir)
    bos = token_text(config.get("bos_token")) or reported.bos_token
    eos = token_text(config.get("eos_token")) or reported.eos_token
    found = find_chat_template(model_dir, config)
    if found is not None:
        return ChatTemplate(found.source, bos, eos, found.origin)
    if reported.chat_template:
        return ChatTemplate(reported.chat_template, bos, eos, "the worker's /capability")
    logger.warning("model %s has no chat template; using ChatML for /v1/chat/completions", model_dir)
    return ChatTemplate(CHATML_TEMPLATE, bos, eos, "ChatML (the model has no chat template)")
