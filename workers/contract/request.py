"""`WorkerRequest`: the one shape of a generation request between the router and a worker.

Design: every public protocol (TGI, OpenAI completions and chat, Responses, Anthropic Messages)
and the canary translate their own names into this value once, at their edge; routing reads its
typed fields; the worker parses it once into its `SamplingParams`. The names are the worker
socket's own, TGI's `/generate` shape with vLLM's extras (`inputs` or `input_ids`,
`parameters{...}`, `resume_ids`), so a TGI client pointed at a worker still works; unknown fields
are ignored, as TGI does. Every limit, default and check lives here, and greedy normalization
only here: a temperature of 0 (or below `MIN_TEMPERATURE`) means greedy with the warpers back to
neutral, and any warper or `do_sample` means sampling. Trade-off: pydantic validates the value
where it is built and again where it is received, a little work per request, so neither side
trusts a dict."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from workers.contract.limits import (
    DEFAULT_MAX_NEW_TOKENS,
    GRAMMAR_TYPES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    grammar_value,
    valid_unicode,
)

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (vLLM's `_SAMPLING_EPS`: 1/1e-300 gives inf, then NaN)
_WIRE = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=True)


class Grammar(BaseModel):
    """`parameters.grammar`: `json` (a schema, as an object or JSON text), `regex`, `json_schema`
    (`{"name", "schema"}`, as TGI 3), `json_object` (any object) and `choice` (a list of strings,
    the output exactly one: vLLM's `guided_choice`). `strict` false lets a schema's unknown
    keywords through (OpenAI's `strict`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["json", "regex", "json_schema", "json_object", "choice"]
    value: Any = None
    strict: StrictBool = True

    @model_validator(mode="after")
    def _value(self):
        self.__dict__["value"] = grammar_value(self.type, self.value)  # loaded and checked for its type
        return self


class GenerationParameters(BaseModel):
    """How one request chooses its tokens, what it reports and when it stops (see the module docstring)."""

    model_config = _WIRE

    max_new_tokens: StrictInt = DEFAULT_MAX_NEW_TOKENS  # 0: score the prompt only (needs `decoder_input_details`)
    do_sample: StrictBool = False  # effective: True when any warper asks for sampling
    temperature: float = 1.0
    top_k: StrictInt = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # a sampled row drops tokens below min_p x its best token's probability (0 = off)
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)  # token id -> bias (zero biases dropped)
    seed: StrictInt | None = None
    stop: tuple[StrictStr, ...] = ()
    include_stop_str_in_output: StrictBool = True  # a matched stop string ends the text (TGI) or is cut off (OpenAI)
    stop_token_ids: tuple[StrictInt, ...] = ()  # tokens that end the answer (`stop_sequence`), besides EOS
    ignore_eos: StrictBool = False  # EOS does not end the answer: drawn and counted like any token
    min_tokens: StrictInt = 0  # before this many tokens, EOS and `stop_token_ids` cannot be drawn, stops do not match
    skip_special_tokens: StrictBool = True  # False: special tokens' text is part of the answer
    details: StrictBool = False  # the answer carries its details (finish reason, tokens, logprobs)
    decoder_input_details: StrictBool = False  # score every prompt token (echo, prompt logprobs)
    top_n_tokens: StrictInt | None = None  # alternatives per token (0..MAX_LOGPROBS); None: not asked
    prompt_top_n_tokens: StrictInt | None = None  # alternatives per prompt token (None: as many as `top_n_tokens`)
    grammar: Grammar | None = None
    return_full_text: StrictBool = False  # the answer's text starts with the prompt

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        """A field sent as null takes its default (TGI clients send nulls)."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _checked(self):
        _check(self)
        _normalize(self.__dict__)
        return self

    @classmethod
    def create(cls, **fields) -> GenerationParameters:
        """From keyword values (None = default); `ValueError` with the problems' own messages
        (`request_error`), where pydantic would raise its `ValidationError`."""
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            raise ValueError(request_error(e.errors())) from None

    @property
    def scoring_only(self) -> bool:
        """`max_new_tokens` = 0: score the prompt, generate nothing."""
        return self.max_new_tokens == 0

    @property
    def greedy(self) -> bool:
        return not self.do_sample


class WorkerRequest(BaseModel):
    """One generation request: the prompt as text (`inputs`) or token ids (`input_ids`), its
    parameters, the token ids already generated for it elsewhere (`resume_ids`: a migrated
    stream goes on after them, workers/engine/resume.py), the LoRA adapter it runs with (`lora`), and
    whether its prompt's KV must be in the host tier before it reports (`publish_kv`)."""

    model_config = _WIRE

    inputs: str = ""
    input_ids: tuple[StrictInt, ...] | None = None
    parameters: GenerationParameters = Field(default_factory=GenerationParameters)
    resume_ids: tuple[StrictInt, ...] = ()
    lora: StrictStr | None = None  # the LoRA adapter it runs with (`--lora NAME=DIR`); None: the base model
    # a prefill for another worker: every block of its prompt (the partly filled last one too) is in
    # the host KV tier before its last event goes out (server/dispatch/disaggregate.py)
    publish_kv: StrictBool = False

    @model_validator(mode="after")
    def _prompt(self):
        valid_unicode(self.inputs, "inputs")  # no tokenizer encodes a lone surrogate: a 422, not a 500
        if self.input_ids is not None and self.inputs:
            raise ValueError("Give the prompt as `inputs` or as `input_ids`, not both")
        return self

    @property
    def prompt(self) -> str | tuple[int, ...]:
        """The prompt as the request gives it: its text, or its token ids."""
        return self.inputs if self.input_ids is None else self.input_ids


def request_error(errors: Sequence[Mapping]) -> str:
    """Validation errors (pydantic's `errors()`) in one line: the first few problems' own
    messages (ours name their field), else pydantic's with the field's dotted path."""
    parts = []
    for err in errors[:5]:
        message = str(err.get("msg", "invalid"))
        if err.get("type") == "value_error":
            parts.append(message.removeprefix("Value error, "))
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"`{loc}`: {message}")
    return "; ".join(parts)


# --- checks and normalization ------------------------------------------------------------------
def _check(p: GenerationParameters) -> None:
    """Every range of the parameters; `ValueError` names the field and what is accepted."""
    n = p.max_new_tokens
    if n < 0 or (n == 0 and not p.decoder_input_details):
        raise ValueError(f"`max_new_tokens` must be an integer >= 1, got `{n}`"
                         + (" (0 is accepted with `decoder_input_details`: prompt scoring)" if n == 0 else ""))
    t = p.temperature
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"`temperature` must be > 0 (or 0 for greedy without `do_sample`), got `{t}`")
    if p.do_sample and t <= 0:
        raise ValueError(f"`temperature` must be > 0 when `do_sample` is true, got `{t}`")
    if p.top_k < 0:
        raise ValueError(f"`top_k` must be an integer >= 0 (0 disables it), got `{p.top_k}`")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"`top_p` must be in (0, 1] (1 disables it), got `{p.top_p}`")
    if not (math.isfinite(p.min_p) and 0.0 <= p.min_p <= 1.0):
        raise ValueError(f"`min_p` must be in [0, 1] (0 disables it), got `{p.min_p}`")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise ValueError(f"`repetition_penalty` must be > 0 (1 disables it), got `{p.repetition_penalty}`")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise ValueError(f"`{name}` must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 disables it), got `{value}`")
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        raise ValueError(f"`seed` must be an integer in [0, {MAX_SEED}], got `{p.seed}`")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"`stop` accepts at most {MAX_STOP_SEQUENCES} sequences, got `{len(p.stop)}`")
    if any(not s for s in p.stop):
        raise ValueError(f"`stop` sequences must be non-empty strings, got `{list(p.stop)}`")
    for s in p.stop:
        valid_unicode(s, "stop")
    for name in ("top_n_tokens", "prompt_top_n_tokens"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got `{value}`")
    if p.ignore_eos and p.grammar is not None:
        raise ValueError("`ignore_eos` cannot go with a grammar, which ends the output where it is complete. "
                         "Accepted: one of them")
    if not 0 <= p.min_tokens <= max(n, 1):
        raise ValueError(f"`min_tokens` must be an integer in [0, {n}] (at most `max_new_tokens`), "
                         f"got `{p.min_tokens}`")
    ids = p.stop_token_ids
    if len(ids) > MAX_STOP_SEQUENCES or any(t < 0 for t in ids):
        raise ValueError(f"`stop_token_ids` must be at most {MAX_STOP_SEQUENCES} token ids (integers >= 0), "
                         f"got `{list(ids)[:MAX_STOP_SEQUENCES + 1]}`")
    _check_bias(p.logit_bias)


def _check_bias(bias: dict[int, float]) -> None:
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"`logit_bias` lists {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are accepted")
    for token, value in bias.items():
        if token < 0:
            raise ValueError(f"`logit_bias` keys must be token ids (integers >= 0), got `{token}`")
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(f"`logit_bias` values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got `{value}` for token `{token}`")


def _normalize(v: dict) -> None:
    """Greedy normalization, in place on a just-validated value (see the module docstring)."""
    t = v["temperature"]
    greedy = t < MIN_TEMPERATURE or not (v["do_sample"] or t != 1.0 or v["top_k"] > 0 or v["top_p"] < 1.0)
    if greedy:
        v.update(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    else:
        v["do_sample"] = True
    v["logit_bias"] = {k: float(b) for k, b in sorted(v["logit_bias"].items()) if b}
    v["stop_token_ids"] = tuple(dict.fromkeys(v["stop_token_ids"]))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v[name] = float(v[name])


__all__ = ["GRAMMAR_TYPES", "MIN_TEMPERATURE", "GenerationParameters", "Grammar", "WorkerRequest", "request_error"]
