"""The worker's HTTP shapes (TGI's), and their conversion to the engine's frozen values.

Pydantic lives only here, at the edge: a request is parsed into `GenerateRequest`, turned
into `SamplingParams` (which validates ranges and names the bad field) and never travels
further. Responses are built as plain dicts from the engine's `TokenEvent` / `FinishInfo`,
which is cheaper per streamed token than a pydantic model.

Beyond TGI's fields the router may send: `input_ids` (a prompt given as token ids; the
answer then carries `input_text`, what they decode to), `presence_penalty`,
`frequency_penalty`, `logit_bias`, `include_stop_str_in_output` (False: a matched stop
string is not part of the text, as OpenAI), `max_new_tokens` = 0 with
`decoder_input_details` (score the prompt, generate nothing), and vLLM's `ignore_eos`,
`min_tokens`, `stop_token_ids`, `skip_special_tokens`, `min_p` and `prompt_top_n_tokens`
(alternatives per prompt token); `details.stop_reason` says which stop string or stop token
id ended an answer. With `top_n_tokens` set (0 included), each token and
each alternative carries its own `bytes` (a token's `text` in a stream is its streamed
piece, which may hold back half a character), so the router can build OpenAI logprobs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from workers.contract import grammar_value, valid_unicode
from workers.engine.events import FinishInfo, TokenEvent
from workers.sampling.grammar import GrammarSpec, json_text
from workers.sampling.logprobs import TokenBytes, TopList, finite
from workers.sampling.params import ParameterError, SamplingParams


class Grammar(BaseModel):
    """TGI's `parameters.grammar`: `json` (a schema, as an object or JSON text), `regex`,
    `json_schema` (`{"name", "schema"}`, as TGI 3), `json_object` (any object) and `choice` (a
    list of strings, the output exactly one: what the router sends for vLLM's `guided_choice`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "regex", "json_schema", "json_object", "choice"]
    value: Any = None
    strict: bool = True

    def spec(self) -> GrammarSpec:
        """The engine's grammar for this shape (`ParameterError` for a malformed one, with the
        router's own wording: both check it with the contract's `grammar_value`)."""
        try:
            value = grammar_value(self.type, self.value)
        except ValueError as e:
            raise ParameterError(str(e)) from None
        if self.type == "regex":
            return GrammarSpec("regex", value)
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.type == "choice":
            return GrammarSpec("choice", json.dumps(value))
        schema = value["schema"] if self.type == "json_schema" else value
        return GrammarSpec("json_schema", json_text(schema), self.strict)


class Parameters(BaseModel):
    """TGI `parameters`; unknown fields are ignored, as TGI clients send several we do not use."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    do_sample: bool = False
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = True  # False: a matched stop string is cut off (OpenAI)
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    grammar: Grammar | None = None
    return_full_text: bool = False
    # vLLM's extras, as the router sends them (workers/sampling/params.py)
    ignore_eos: bool = False
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    min_p: float | None = None
    prompt_top_n_tokens: int | None = None  # alternatives per prompt token (vLLM's `prompt_logprobs`)

    @property
    def scoring_only(self) -> bool:
        """`max_new_tokens` = 0: score the prompt, generate nothing (needs `decoder_input_details`)."""
        return self.max_new_tokens == 0

    def sampling(self) -> SamplingParams:
        if self.scoring_only and not self.decoder_input_details:
            raise ParameterError("`max_new_tokens` must be an integer >= 1 "
                                 "(0 is accepted with `decoder_input_details`: prompt scoring)")
        return SamplingParams.create(
            max_new_tokens=1 if self.scoring_only else self.max_new_tokens, do_sample=self.do_sample,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, logprobs=self.top_n_tokens, prompt_logprobs=self.decoder_input_details,
            grammar=None if self.grammar is None else self.grammar.spec(), prompt_only=self.scoring_only,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens, min_p=self.min_p, prompt_top=self.prompt_top_n_tokens,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str = ""
    input_ids: list[int] | None = None
    parameters: Parameters = Field(default_factory=Parameters)
    # Token ids already generated for this request on another worker (a migrated stream): the
    # answer goes on after them, as the original would have (workers/engine/resume.py).
    resume_ids: list[StrictInt] = Field(default_factory=list)

    @field_validator("inputs")
    @classmethod
    def _unicode(cls, value: str) -> str:
        """The tokenizer cannot encode a lone surrogate (valid JSON, not valid Unicode): a 422, not a 500."""
        return valid_unicode(value, "inputs")


class AbortStreams(BaseModel):
    """`POST /streams/abort`: streams of a channel whose clients left (workers/serving/channel.py)."""

    model_config = ConfigDict(extra="forbid")

    channel: str
    streams: list[StrictInt]


class Render:
    """Turns one request's engine events into TGI dicts (with the extensions above)."""

    __slots__ = ("tokens", "logprobs", "prefix", "input_text", "scoring_only")

    def __init__(self, tokens: TokenBytes, params: Parameters, prefix: str, input_text: str | None):
        self.tokens = tokens
        # tokens carry their bytes and alternatives (asked for the output's tokens or the prompt's)
        self.logprobs = params.top_n_tokens is not None or params.prompt_top_n_tokens is not None
        self.prefix, self.input_text, self.scoring_only = prefix, input_text, params.scoring_only

    def _alt(self, token_id: int, logprob: float | None) -> dict:
        b = self.tokens(token_id)
        return {"id": token_id, "text": b.decode("utf-8", errors="replace"), "logprob": finite(logprob),
                "special": token_id in self.tokens.special_ids, "bytes": list(b)}

    def _top(self, top: TopList | None) -> list[dict]:
        return [self._alt(i, lp) for i, lp in top or ()]

    def token(self, e: TokenEvent) -> dict:
        d = {"id": e.token_id, "text": e.text, "logprob": finite(e.logprob), "special": e.special}
        if self.logprobs:
            d["bytes"] = list(self.tokens(e.token_id))
        return d

    def prefill(self, entries) -> list[dict]:
        out = []
        for token_id, logprob, top in entries or ():
            d = {"id": token_id, "text": self.tokens.text(token_id), "logprob": finite(logprob)}
            if self.logprobs:
                d["special"] = token_id in self.tokens.special_ids
                d["bytes"] = list(self.tokens(token_id))
                d["top_tokens"] = self._top(top)
            out.append(d)
        return out

    @staticmethod
    def details(f: FinishInfo) -> dict:
        d = {"finish_reason": f.reason, "generated_tokens": f.generated_tokens,
             "input_length": f.input_length, "seed": f.seed}
        if f.stop_reason is not None:  # the stop string matched, or the stop token id (vLLM's `stop_reason`)
            d["stop_reason"] = f.stop_reason
        return d

    def response(self, events: list[TokenEvent], details: bool) -> dict:
        """`/generate` body from one request's events (the last carries `finish`)."""
        finish, prefill = events[-1].finish, events[0].prefill
        if self.scoring_only:  # the one token drawn to finish the prefill is not an answer
            finish = replace(finish, reason="length", generated_text="", generated_tokens=0)
            events = []
        body: dict = {"generated_text": self.prefix + finish.generated_text}
        if self.input_text is not None:
            body["input_text"] = self.input_text
        if details:
            d = {**self.details(finish), "prefill": self.prefill(prefill),
                 "tokens": [self.token(e) for e in events]}
            if self.logprobs:
                d["top_tokens"] = [self._top(e.top) for e in events]
            body["details"] = d
        return body

    def event(self, e: TokenEvent) -> dict:
        """One `/generate_stream` event; the first may carry `prefill` and `input_text`, the last
        the full text and the details."""
        f = e.finish
        out = {"index": e.index, "token": self.token(e),
               "generated_text": None if f is None else self.prefix + f.generated_text,
               "details": None if f is None else self.details(f)}
        if self.logprobs:
            out["top_tokens"] = self._top(e.top)
        if e.index == 0:
            if e.prefill is not None:
                out["prefill"] = self.prefill(e.prefill)
            if self.input_text is not None:
                out["input_text"] = self.input_text
        return out
