"""OpenAI request shapes for `/v1/completions` and `/v1/chat/completions` (pydantic, HTTP edge only).

Accepted as OpenAI defines them, with vLLM's extensions (server/protocol/openai/extras.py,
guided.py); the fields and what each does: docs/serving.md and docs/clients.md. Fields this
server cannot honour are refused with a 422 naming them (`best_of` > 1, `suffix`, image parts),
and a field neither declares is kept and refused by name at the edge (server/protocol/base.py).
Design: `sampling()` translates a request into the contract's `GenerationParameters`
(workers/contract/request.py) once, here, and tools and response formats become a grammar in
server/protocol/openai/tools.py, so nothing below the edge knows OpenAI's names. Trade-off: the
shapes are declared twice, once as OpenAI spells them here and once in the contract, in exchange
for one place where the public names are translated.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from server.protocol.base import TOKENS_MAX, Edge, StopText, json_schema_value, refuse
from server.protocol.openai.extras import VLLMExtras
from server.protocol.openai.guided import GuidedDecoding
from workers.contract import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    GenerationParameters,
    valid_unicode,
)
from workers.contract.errors import shown
from workers.contract.json_schema import MAX_JSON_DEPTH, check_json_value

MAX_CHOICES = 8  # n x prompts per OpenAI request
_TOKEN_ID_DIGITS = 10  # a `logit_bias` key: at most this many ASCII digits (a 4,300-digit key made `int()` raise)
_TOKEN_ID_KEY = re.compile(rf"[0-9]{{1,{_TOKEN_ID_DIGITS}}}")
MAX_TEMPLATE_KWARGS = 64
# template variables a request sets through its own fields, never through `chat_template_kwargs`
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")
REASONING_EFFORTS = ("low", "medium", "high")

PromptText = Annotated[str, Field(min_length=1, max_length=1_000_000)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=1_000_000)]


class StreamOptions(Edge):
    include_usage: bool = False


class _OpenAISampling(VLLMExtras):
    model: str | None = Field(None, max_length=1000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    user: str | None = Field(None, max_length=1000)
    # OpenAI's newer names: requests sharing `prompt_cache_key` share a cache (the routing session,
    # before `user`); `safety_identifier` is `user`'s successor; `store` false asks for what this
    # server does anyway (it keeps no completion), `store` true is refused
    prompt_cache_key: str | None = Field(None, max_length=1000)
    safety_identifier: str | None = Field(None, max_length=1000)
    store: bool | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)

    @model_validator(mode="after")
    def _sampling_fields(self):
        refuse(self, {"store": (None, False)})  # nothing is stored: `true` would mislead
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"`stop` has {len(stops)} sequences; at most {MAX_STOP_SEQUENCES} are accepted")
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):  # ASCII only: `"²".isdigit()` and `"١٢".isdigit()` hold too
                raise ValueError(f"`logit_bias` keys must be token ids (integers as strings: ASCII digits, at most "
                                 f"{_TOKEN_ID_DIGITS}), got `{shown(key)}`")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"`logit_bias` values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                                 f"`{value}` for token `{key}`")
        return self

    def session_key(self) -> str | None:
        """The routing session these fields name (after `X-Session-Id`): the cache key, else the user."""
        return self.prompt_cache_key or self.user or self.safety_identifier

    def sampling(self, max_tokens: int | None, defaults: dict | None = None, **more) -> GenerationParameters:
        """The contract's parameters for these OpenAI fields, each public name translated here
        once. A field the request leaves out takes the model's generation_config value
        (`defaults`), then OpenAI's. OpenAI samples unless the temperature is 0; the contract
        makes temperature 0 greedy, with the warpers off. `more`: contract fields the route adds
        (`grammar`, `top_n_tokens`, `decoder_input_details`). `ValueError` for a combination only
        the contract checks."""
        defaults = defaults or {}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        temperature, top_p, top_k = pick("temperature", 1.0), pick("top_p", None), pick("top_k", None)
        repetition_penalty = pick("repetition_penalty", None)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        # a model's generation_config value outside its range is no request's fault: off, as if absent
        fields = dict(
            details=True, do_sample=temperature > 0, temperature=temperature, max_new_tokens=max_tokens,
            top_p=top_p if top_p is not None and 0 < top_p <= 1.0 else None,
            top_k=top_k if top_k is not None and top_k > 0 else None,  # vLLM's -1 (and 0): off
            repetition_penalty=(repetition_penalty if repetition_penalty is not None and repetition_penalty > 0
                                else None),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, seed=self.seed, stop=stops,
            **self.extra_parameters(),  # vLLM's extras (server/protocol/openai/extras.py)
        )
        scored = more.pop("decoder_input_details", False)  # the route's, or vLLM's `prompt_logprobs`
        fields["decoder_input_details"] = fields["decoder_input_details"] or scored
        return GenerationParameters.create(**fields, **more)


class CompletionRequest(GuidedDecoding, _OpenAISampling):
    prompt: PromptText | list[PromptText] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0, le=TOKENS_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        count = len(self.prompts) * self.n
        if not 1 <= count <= MAX_CHOICES:
            raise ValueError(f"`prompt` x `n` gives {count} choices. Accepted: 1 to {MAX_CHOICES}")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("`max_tokens` = 0 scores the prompt only and needs `echo` = true")
        refuse(self, {"best_of": (None, 1), "suffix": (None, "")})
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def scoring_only(self) -> bool:
        return self.max_tokens == 0


class TextPart(Edge):
    type: Literal["text"]
    text: str


class ToolCallFunction(Edge):
    name: str = Field(max_length=64)
    arguments: str = Field("", max_length=1_000_000)

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, value: str) -> str:
        """Arguments that parse as JSON reach the template as that value: bounded in depth and valid Unicode."""
        valid_unicode(value, "tool_calls.function.arguments")
        try:
            parsed = json.loads(value)
        except ValueError:
            return value  # not JSON: rendered as an empty object, as before
        except RecursionError:
            raise ValueError(f"`tool_calls.function.arguments` nests deeper than {MAX_JSON_DEPTH} levels") from None
        check_json_value(parsed, "`tool_calls.function.arguments`")
        return value


class ToolCallIn(Edge):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    id: str | None = Field(None, max_length=200)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Edge):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=200)
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning (vLLM's name)
    reasoning: str | None = None  # the same, under vLLM's newer name

    @model_validator(mode="after")
    def _unicode(self):
        """A lone surrogate (`"\\ud800"`, valid JSON) cannot be encoded, so no tokenizer takes it."""
        valid_unicode(self.text(), "content")
        valid_unicode(self.name or "", "name")
        valid_unicode(self.reasoning_text() or "", "reasoning_content")
        return self

    def reasoning_text(self) -> str | None:
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaFormat(Edge):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True, populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.schema_ is None:
            raise ValueError("`response_format.json_schema.schema` is required")
        self.schema_ = json_schema_value(self.schema_, "response_format.json_schema.schema")
        return self


class ResponseFormat(Edge):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`response_format.json_schema` is required when `type` is `json_schema`")
        return self


class FunctionDef(Edge):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _renderable(self):
        """What the template renders and the grammar compiles: bounded in depth, valid Unicode."""
        valid_unicode(self.description or "", "tools.function.description")
        check_json_value(self.parameters, "`tools.function.parameters`")
        return self


class Tool(Edge):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Edge):
    name: str = Field(max_length=64)


class NamedToolChoice(Edge):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GuidedDecoding, _OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _effort(cls, value):
        if value is None or value in REASONING_EFFORTS:
            return value
        shown = value[:60] if isinstance(value, str) else json.dumps(value, default=str)[:60]
        raise ValueError(f"`{shown}` is not a reasoning effort. Accepted: {', '.join(REASONING_EFFORTS)}, or null")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value):
        if value is None:
            return None
        if not isinstance(value, dict):
            shown = json.dumps(value)[:60] if isinstance(value, (str, int, float, bool, list)) else type(value).__name__
            raise ValueError(f"must be an object of template variables, got `{shown}`. Accepted: an object such "
                             'as {"enable_thinking": false}, or null')
        if len(value) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"has {len(value)} variables; at most {MAX_TEMPLATE_KWARGS} are accepted")
        for name in value:
            if name in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"`{name}` is set by the request itself, not here. Accepted: any other template "
                                 f"variable (not {', '.join(RESERVED_TEMPLATE_VARIABLES)})")
            valid_unicode(name, "chat_template_kwargs")
        # bounded depth (json.dumps of 960 levels raised), valid Unicode
        check_json_value(value, "`chat_template_kwargs`")
        return value

    @model_validator(mode="after")
    def _supported(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` = true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"`tools` names must be unique, got `{names}`")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            shown = choice if isinstance(choice, str) else f"function `{choice.function.name}`"
            raise ValueError(f"`tool_choice` = `{shown}` needs `tools`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"`tool_choice` names function `{choice.function.name}`, which is not in `tools`. "
                             f"Accepted: {', '.join(names)}")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("`response_format` and a forced `tool_choice` both constrain the output; send one")
        kwarg = (self.chat_template_kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if self.reasoning_effort is not None and kwarg != self.reasoning_effort:
            raise ValueError(f"`reasoning_effort` = `{self.reasoning_effort}` and "
                             f"`chat_template_kwargs.reasoning_effort` = `{kwarg}` disagree. "
                             "Accepted: one of them, or the same value in both")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` when set."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_n(self) -> int | None:
        """Alternatives per token the worker reports (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None
