"""Request and response shapes of the public API (pydantic, used only at the HTTP edge).

TGI shapes for `/generate` (`inputs`, `parameters{...}`) and OpenAI shapes for `/v1/*`.
Clients of both send fields this server cannot honour (`best_of`, `grammar`, `logprobs`,
penalties...); those are accepted when they ask for nothing (null, 0, false, 1) and refused
with a 422 naming the field otherwise, never silently ignored. Unknown fields are ignored,
as TGI and OpenAI servers do. Types are strict (an integer field refuses `"5"`, `true` and
`2.0`), floats must be finite, and text must be valid Unicode (no lone surrogate such as
`"\ud800"`, which no tokenizer can encode). Internally the router forwards plain
dicts; nothing below the edge sees these classes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP = 4
MAX_CHOICES = 8  # n x prompts per OpenAI request
_SEED_MAX = 2**63 - 1
_TOKENS_MAX = 1_000_000

StopText = Annotated[str, Field(min_length=1, max_length=1000)]


class _Edge(BaseModel):
    # strict: `"5"`, `true` and `2.0` are not integers, `"true"` is not a boolean (as the OpenAI API)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


def _refuse(model: BaseModel, allowed: dict[str, tuple]) -> None:
    """422 for fields set to something this server cannot do (names field and accepted values)."""
    for name, ok_values in allowed.items():
        value = getattr(model, name)
        if value not in ok_values:
            shown = ", ".join("null" if v is None else str(v).lower() for v in ok_values)
            raise ValueError(f"`{name}` = `{value}` is not supported. Accepted: {shown}")


# --- TGI ---------------------------------------------------------------------------------
class GenerateParameters(_Edge):
    max_new_tokens: int | None = Field(None, ge=1, le=_TOKENS_MAX, description="tokens to generate (default 100)")
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, ge=1, le=1_000_000)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    do_sample: bool | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    stop: list[StopText] | None = Field(None, max_length=MAX_STOP)
    details: bool = False
    return_full_text: bool | None = None
    decoder_input_details: bool = False
    # sent by TGI clients; only their "off" values are accepted
    best_of: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    truncate: int | None = None
    top_n_tokens: int | None = None
    frequency_penalty: float | None = None
    grammar: Any = None
    adapter_id: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        _refuse(self, {"best_of": (None, 1), "typical_p": (None, 1.0), "watermark": (False,), "truncate": (None,),
                       "top_n_tokens": (None, 0), "frequency_penalty": (None, 0.0), "grammar": (None,),
                       "adapter_id": (None, "")})
        return self

    def to_worker(self) -> dict:
        """The worker's `parameters` (only what it understands; unset fields take its defaults)."""
        keep = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "do_sample", "seed",
                "stop", "details", "return_full_text")
        out = {k: getattr(self, k) for k in keep if getattr(self, k) is not None}
        if self.decoder_input_details:
            out["details"] = True
        return out


class GenerateRequest(_Edge):
    inputs: str = Field(min_length=1, max_length=1_000_000)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False  # used by `POST /` (TGI's compat route) only


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool


class GenerateDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    input_length: int | None = None
    seed: int | None = None
    prefill: list[Any] = []
    tokens: list[Token] = []


class GenerateResponse(BaseModel):
    generated_text: str
    details: GenerateDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str


# --- OpenAI ------------------------------------------------------------------------------
class StreamOptions(_Edge):
    include_usage: bool = False


class _OpenAISampling(_Edge):
    model: str | None = Field(None, max_length=1000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = Field(None, ge=0, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)

    @model_validator(mode="after")
    def _stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"`stop` has {len(stops)} sequences; at most {MAX_STOP} are accepted")
        _refuse(self, {"presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0)})
        if self.logit_bias:
            raise ValueError("`logit_bias` is not supported. Accepted: null or {}")
        return self

    def sampling(self, max_tokens: int | None, defaults: dict | None = None) -> dict:
        """Worker `parameters` for these OpenAI fields (temperature 0 means greedy). A field the
        request leaves out takes the model's generation_config value (`defaults`), then OpenAI's."""
        defaults = defaults or {}

        def pick(name: str, fallback):
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        temperature = pick("temperature", 1.0)
        p: dict[str, Any] = {"details": True, "do_sample": temperature > 0}
        if temperature > 0:
            p["temperature"] = temperature
        if max_tokens is not None:
            p["max_new_tokens"] = max_tokens
        top_p, top_k, repetition_penalty = pick("top_p", None), pick("top_k", None), pick("repetition_penalty", None)
        if temperature > 0 and top_p is not None and 0 < top_p < 1.0:
            p["top_p"] = top_p
        if temperature > 0 and top_k is not None and top_k > 0:
            p["top_k"] = top_k
        if repetition_penalty is not None and repetition_penalty > 0:
            p["repetition_penalty"] = repetition_penalty
        if self.seed is not None:
            p["seed"] = self.seed
        if self.stop:
            p["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return p


class CompletionRequest(_OpenAISampling):
    prompt: Annotated[str, Field(min_length=1, max_length=1_000_000)] | list[
        Annotated[str, Field(min_length=1, max_length=1_000_000)]]
    max_tokens: int | None = Field(16, ge=1, le=_TOKENS_MAX)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        if isinstance(self.prompt, list) and not 1 <= len(self.prompt) * self.n <= MAX_CHOICES:
            raise ValueError(f"`prompt` x `n` gives {len(self.prompt) * self.n} choices. Accepted: 1 to {MAX_CHOICES}")
        _refuse(self, {"logprobs": (None,), "best_of": (None, 1), "suffix": (None, "")})
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(_Edge):
    type: Literal["text"]
    text: str


class ChatMessage(_Edge):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _unicode(self):
        """A lone surrogate (`"\\ud800"`, valid JSON) cannot be encoded, so no tokenizer takes it."""
        for field, value in (("content", self.text()), ("name", self.name or "")):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = value[e.start:e.end].encode("unicode_escape").decode()
                raise ValueError(f"`{field}` is not valid Unicode: a lone surrogate `{bad}` at character {e.start}. "
                                 "Accepted: text whose \\ud800-\\udfff escapes come in valid pairs") from None
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ResponseFormat(_Edge):
    type: Literal["text"]


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(None, ge=1, le=_TOKENS_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=_TOKENS_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _supported(self):
        _refuse(self, {"logprobs": (None, False), "top_logprobs": (None, 0), "tool_choice": (None, "none")})
        if self.tools:
            raise ValueError("`tools` is not supported. Accepted: null or []")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        """Messages as chat templates expect them: role and plain-text content."""
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            out.append(d)
        return out
