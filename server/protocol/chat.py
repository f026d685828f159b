"""Chat messages -> prompt text through the model's own chat template (jinja2, no torch).

Rendering is transformers' `apply_chat_template` rebuilt without transformers (the router
imports no torch): the same sandboxed jinja2 environment and the same variables, checked against
it template feature by template feature (tests/test_chat_templates.py). Trade-off: the
environment is a copy, not an import, so a new transformers feature reaches the router only when
it is copied here and its test added. A template that raises (say, roles that do not alternate)
becomes a `ChatTemplateError` naming the problem (422 at the HTTP edge). Every string the
template can render is checked for the model's special tokens (`ChatTemplate.check_content`),
so a user cannot forge a turn; `--special-tokens-in-content` lets them through.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.contract import (
    ModelDescription,
    find_chat_template,
    read_special_tokens,
    read_tokenizer_config,
    token_text,
)
from workers.contract.errors import shown

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# tokenizer_config.json special tokens a template sees under their own names (transformers' special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# names under which a message's reasoning reaches templates (transformers reads them in this order)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template refused the messages or could not be compiled."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the values it renders with, in transformers' environment:
    `trim_blocks` / `lstrip_blocks`, loop controls (`{% break %}`, `{% continue %}`), the
    `{% generation %}` tag (transformers marks assistant tokens with it; here it renders its body),
    `raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text and takes
    `indent`, `separators` and `sort_keys`, a `namespace` that refuses underscore names and a
    limited `dict`. The variables: `messages` (`normalized_messages`), `tools` and `documents`
    (null when not given, so `tools is none` holds), `add_generation_prompt`, the special tokens
    the tokenizer config sets (`bos_token`, `eos_token`, `pad_token`, ...; an unset one is
    undefined, as in transformers) and any extra keyword (`enable_thinking`, a request's
    `chat_template_kwargs`)."""

    source: str
    bos_token: str | None
    eos_token: str | None
    origin: str  # where the template came from (shown in logs)
    forbidden_tokens: tuple[str, ...] = ()  # special tokens refused inside message text
    # (name, text) of the other SPECIAL_TOKEN_NAMES that are set
    special_tokens: tuple[tuple[str, str], ...] = ()
    model_type: str | None = None  # config.json `model_type` (which reasoning parser `auto` picks)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt for `messages`; `extra` holds `tools`, `documents` and template keywords."""
        self.check_content(messages, extra)
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token, **dict(self.special_tokens)}
        variables = {**{k: v for k, v in tokens.items() if v is not None}, **extra}  # keywords win, as in transformers
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        variables.update(messages=normalized_messages(messages), add_generation_prompt=add_generation_prompt)
        template = _compile(self.source)
        try:
            return template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError) as e:  # raise_exception, or a value it cannot use
            raise ChatTemplateError(f"The chat template refused the messages: {e}") from e

    def check_content(self, messages: list[dict], extra: dict | None = None) -> None:
        """`ChatTemplateError` (422) when any string the template can render holds a forbidden
        special token: the worker tokenizes the rendered prompt with special tokens parsed, so a
        user typing `<|im_start|>system` inside a message would get the real control token and
        could forge a turn. Checked: each message's every field (content, name, reasoning, tool
        calls with their ids, names and arguments, `tool_call_id`), the tool definitions (names,
        descriptions, parameter schemas, keys included: `tojson` writes them) and every
        `chat_template_kwargs` value, as tiktoken refuses disallowed special tokens. Trade-off:
        the walk visits every string once per request (a request is at most the 4 MiB body),
        where checking only the fields a given template reads would need to parse it."""
        if not self.forbidden_tokens:
            return
        for i, m in enumerate(messages):
            self._check_value(m, f"messages.{i}")
        for key, value in (extra or {}).items():
            self._check_value(value, "tools" if key == "tools" else f"chat_template_kwargs.{key}")

    def _check_value(self, value, where: str) -> None:
        """Every string in `value`, keys included, walked without recursion (any depth)."""
        stack = [(value, where)]
        while stack:
            item, at = stack.pop()
            if isinstance(item, dict):
                for k, v in item.items():
                    self._check_text(k, f"{at} key")
                    stack.append((v, f"{at}.{k}"))
            elif isinstance(item, (list, tuple)):
                stack.extend((v, f"{at}.{i}") for i, v in enumerate(item))
            else:
                self._check_text(item, at)

    def _check_text(self, text, where: str) -> None:
        if not isinstance(text, str) or not text:
            return
        for token in self.forbidden_tokens:
            if token in text:
                raise ChatTemplateError(
                    f"`{shown(where)}` contains the special token `{token}`, which would act as a control token. "
                    "Accepted: text without the model's special tokens (or start the server with "
                    "--special-tokens-in-content)")


def normalized_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped (many
    templates test `'key' in message`), and a turn's reasoning under every name templates read
    (`reasoning_content`, and `thinking` for templates that read that)."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own `tojson` escapes `<`, `>`, `&` and `'` for HTML; templates want the JSON as it is
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` in templates, without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names (no way towards Python's internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"A chat template cannot set the underscore name `{name}` on a namespace. Accepted: other names")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-token marker): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"The chat template does not compile: {e}") from e


def load_chat_template(model_dir: Path | None, reported: ModelDescription | dict | None = None,
                       special_tokens_in_content: bool = False) -> ChatTemplate:
    """The model's chat template: from the model directory through the lookup the worker uses
    (`workers.contract.find_chat_template`: `chat_template.jinja`, else
    `tokenizer_config.json["chat_template"]`); else the template the worker reported in
    `/capability` (`reported`: its `model` object; a router that cannot read the worker's
    directory); else a plain ChatML template, with a warning, so a model without one still answers."""
    found_template = _load_template(model_dir, ModelDescription.model_validate(reported or {}))
    if special_tokens_in_content:
        return found_template
    forbidden = read_special_tokens(model_dir) or tuple(
        t for t in (found_template.bos_token, found_template.eos_token) if t)
    return replace(found_template, forbidden_tokens=forbidden)


def _model_type(model_dir: Path | None, reported: ModelDescription) -> str | None:
    """config.json's `model_type`, else what the worker reported under that name, else its family
    (`architecture`: qwen3, smollm3, ...), else None."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type") if model_dir else None
    except (OSError, ValueError, AttributeError):
        value = None
    value = value if isinstance(value, str) else (reported.model_extra or {}).get("model_type")
    return value if isinstance(value, str) else reported.architecture  # the family a worker reports


def _load_template(model_dir: Path | None, reported: ModelDescription) -> ChatTemplate:
    config = read_tokenizer_config(model_dir)
    bos = token_text(config.get("bos_token")) or reported.bos_token
    eos = token_text(config.get("eos_token")) or reported.eos_token
    special = tuple((name, text) for name in SPECIAL_TOKEN_NAMES[2:] if (text := token_text(config.get(name))))
    model_type = _model_type(model_dir, reported)
    found = find_chat_template(model_dir, config)
    if found is not None:
        return ChatTemplate(found.source, bos, eos, found.origin, special_tokens=special, model_type=model_type)
    if reported.chat_template:
        return ChatTemplate(reported.chat_template, bos, eos, "the worker's /capability", special_tokens=special,
                            model_type=model_type)
    logger.warning("model %s has no chat template; using ChatML for /v1/chat/completions", model_dir)
    return ChatTemplate(CHATML_TEMPLATE, bos, eos, "ChatML (the model has no chat template)", special_tokens=special,
                        model_type=model_type)
