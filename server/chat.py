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
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.contract import ModelDescription, find_chat_template, read_tokenizer_config, token_text

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

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        try:
            template = _compile(self.source)
            return template.render(messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                   add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"The chat template refused the messages: {e}") from e


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


def load_chat_template(model_dir: Path | None, reported: ModelDescription | dict | None = None) -> ChatTemplate:
    """The model's chat template (see the module docstring for the order of sources);
    `reported` is the `model` object of a worker's `/capability`."""
    reported = ModelDescription.model_validate(reported or {})
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
