"""The worker's HTTP shapes (TGI's), and their conversion to the engine's frozen values.

Pydantic lives only here, at the edge: a request is parsed into `GenerateRequest`, turned
into `SamplingParams` (which validates ranges and names the bad field) and never travels
further. Responses are built as plain dicts from the engine's `TokenEvent` / `FinishInfo`,
which is cheaper per streamed token than a pydantic model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from workers.engine import FinishInfo, TokenEvent
from workers.sampling import SamplingParams


class Parameters(BaseModel):
    """TGI `parameters`; unknown fields are ignored, as TGI clients send several we do not use."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool = False
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    details: bool = False
    return_full_text: bool = False

    def sampling(self) -> SamplingParams:
        return SamplingParams.create(
            max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, temperature=self.temperature,
            top_k=self.top_k, top_p=self.top_p, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=self.stop,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str
    parameters: Parameters = Field(default_factory=Parameters)

    @field_validator("inputs")
    @classmethod
    def _unicode(cls, value: str) -> str:
        """The tokenizer cannot encode a lone surrogate (valid JSON, not valid Unicode): a 422, not a 500."""
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
        return value


def token_dict(e: TokenEvent) -> dict:
    return {"id": e.token_id, "text": e.text, "logprob": e.logprob, "special": e.special}


def stream_details(f: FinishInfo) -> dict:
    return {
        "finish_reason": f.reason, "generated_tokens": f.generated_tokens,
        "input_length": f.input_length, "seed": f.seed,
    }


def generate_response(events: list[TokenEvent], prefix: str, details: bool) -> dict:
    """`/generate` body from one request's events (the last carries `finish`)."""
    finish = events[-1].finish
    body: dict = {"generated_text": prefix + finish.generated_text}
    if details:
        body["details"] = {**stream_details(finish), "prefill": [], "tokens": [token_dict(e) for e in events]}
    return body


def stream_event(e: TokenEvent, prefix: str) -> dict:
    """One `/generate_stream` event; the last carries the full text and the details."""
    f = e.finish
    return {
        "index": e.index,
        "token": token_dict(e),
        "generated_text": None if f is None else prefix + f.generated_text,
        "details": None if f is None else stream_details(f),
    }
