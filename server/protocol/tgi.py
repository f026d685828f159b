"""TGI's request shapes for `/generate` (`inputs`, `parameters{...}`): pydantic, HTTP edge only.

Design: `GenerateRequest.to_worker()` translates one into the contract's `WorkerRequest` (the
same names), the one shape a worker receives, so nothing below the edge sees these classes.
Types are strict (an integer field refuses `"5"`, `true` and `2.0`), floats must be finite, and
text must be valid Unicode (no lone surrogate, which no tokenizer can encode). Fields this server
cannot honour (`best_of`, `watermark`, `truncate`...) are accepted when they ask for nothing
(null, 0, false, 1) and refused with a 422 naming the field otherwise. Trade-off: other unknown
fields are ignored, as TGI does, so TGI's clients keep working, but a misspelt field passes
unnoticed (the OpenAI-shaped routes refuse them: server/protocol/base.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from server.protocol.base import TOKENS_MAX, Edge, StopText, refuse
from workers.contract import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    GenerationParameters,
    WorkerRequest,
    grammar_value,
)


# --- TGI ---------------------------------------------------------------------------------
class TGIGrammar(Edge):
    """`parameters.grammar`: `{"type": "json", "value": <schema>}`, `{"type": "regex", "value":
    "<pattern>"}` or `{"type": "json_schema", "value": {"name": ..., "schema": <schema>}}`."""

    type: Literal["json", "regex", "json_schema"]
    value: Any

    @model_validator(mode="after")
    def _value(self):
        self.value = grammar_value(self.type, self.value)  # the workers' own check (the contract's)
        return self


class GenerateParameters(Edge):
    max_new_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX,
                                       description=f"tokens to generate (default {DEFAULT_MAX_NEW_TOKENS})")
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, ge=1, le=1_000_000)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    do_sample: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[StopText] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    details: bool = False
    return_full_text: bool | None = None
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    grammar: TGIGrammar | None = None
    # sent by TGI clients; only their "off" values are accepted
    best_of: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    truncate: int | None = None
    adapter_id: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        refuse(self, {"best_of": (None, 1), "typical_p": (None, 1.0), "watermark": (False,), "truncate": (None,),
                       "adapter_id": (None, "")})
        return self

    def to_worker(self) -> GenerationParameters:
        """The worker's parameters (the same names; unset fields take the contract's defaults).
        `ValueError` for a combination only the contract checks."""
        keep = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty",
                "do_sample", "seed", "stop", "details", "return_full_text", "decoder_input_details")
        out = {k: getattr(self, k) for k in keep}
        out["details"] = self.details or self.decoder_input_details
        out["top_n_tokens"] = self.top_n_tokens or None  # TGI: 0 and null both mean no alternatives
        if self.grammar is not None:
            out["grammar"] = {"type": self.grammar.type, "value": self.grammar.value}
        return GenerationParameters.create(**out)


class GenerateRequest(Edge):
    inputs: str = Field(min_length=1, max_length=1_000_000)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False  # used by `POST /` (TGI's compat route) only

    def to_worker(self) -> WorkerRequest:
        """The contract's request (`ValueError` for a combination only the contract checks)."""
        return WorkerRequest(inputs=self.inputs, parameters=self.parameters.to_worker())


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
    top_tokens: list[list[Token]] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: GenerateDetails | None = None


class ErrorResponse(BaseModel):
    error: str
    error_type: str
