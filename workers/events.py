"""What the engine hands the HTTP side for each request: token events, the finish, errors.

Frozen values made on the engine thread and read on the event loop; `workers/schemas.py`
turns them into TGI-shaped dicts. A token event may carry the best alternatives of its token
(`top`, when the request asked for logprobs) and, the first one, the prompt's own logprobs
(`prefill`, when it asked to score its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.logprobs import TopList


@dataclass(frozen=True)
class RequestTimings:
    """Where one request's time went, in seconds: waiting for the engine, the step that produced
    its first token (the prefill), and the steps after it (the decode)."""

    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class FinishInfo:
    reason: str  # "length" | "eos_token" | "stop_sequence"
    generated_text: str
    generated_tokens: int
    input_length: int
    seed: int | None
    timings: RequestTimings | None = None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int
    token_id: int
    text: str
    logprob: float
    special: bool
    finish: FinishInfo | None = None
    top: TopList | None = None  # the best alternatives, when the request asked (`logprobs`)
    prefill: tuple | None = None  # on the first event: (id, logprob, top) per prompt token, when asked


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    error_type: str = "internal"
