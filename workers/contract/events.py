"""What a worker's engine says about one request, as values, and their binary form on the channel.

Design: the engine makes frozen `TokenEvent`s (token id, logprob, alternatives, the finish),
`FinishInfo` and `ErrorEvent`s; the worker's own routes render them as TGI text, and the router's
stream channel carries them as token ids instead (`encode_batch` / `decode_batch`: msgpack through
msgspec, one record per stream per step), so detokenization, stop strings and every client-facing
frame are built in the router, not in the engine's interpreter. A batch's first record may carry
the stream's `StreamStart` (the prompt's last tokens, which the detokenizer needs to decode the
first piece in context, the prompt's length and the seed). Trade-off: a tuple layout rather than a
self-describing map, which keeps a step's frame small and its encoding one C call; both ends
import this module, so the layout is defined once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

MIN_LOGPROB = -9999.0  # what -inf is reported as (vLLM's value)
FINISH_LENGTH, FINISH_EOS, FINISH_STOP, FINISH_ABORT = "length", "eos_token", "stop_sequence", "aborted"

TopList = tuple[tuple[int, float], ...]  # (token id, logprob), best first


def finite(logprob: float | None) -> float | None:
    """A logprob JSON can carry: -inf (and NaN) become `MIN_LOGPROB`."""
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


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
    stop_reason: str | int | None = None  # the stop string matched, or the stop token id (vLLM's name)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int
    token_id: int
    text: str
    logprob: float
    special: bool
    finish: FinishInfo | None = None
    top: TopList | None = None  # the best alternatives, when the request asked (`top_n_tokens`)
    prefill: tuple | None = None  # on the first event: (id, logprob, top) per prompt token, when asked


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    error_type: str = "internal"


def is_last(event: TokenEvent | ErrorEvent) -> bool:
    """A stream ends with its finish or an error."""
    return isinstance(event, ErrorEvent) or event.finish is not None


@dataclass(frozen=True)
class StreamStart:
    """What the router's renderer needs of a stream before its first token: the prompt's last
    token ids (the detokenizer's context), the prompt's length and the seed drawn."""

    prompt_tail: tuple[int, ...]
    input_length: int
    seed: int | None


# --- the channel's binary form -----------------------------------------------------------
# A record: [start | None, event, event, ...]; start: [prompt_tail, input_length, seed];
# a token event: [index, token_id, logprob, special, top | None, prefill | None, finish | None];
# finish: [reason, generated_tokens, input_length, seed, stop_reason]; an error event: [message, type].
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _finish_wire(f: FinishInfo | None):
    return None if f is None else (f.reason, f.generated_tokens, f.input_length, f.seed, f.stop_reason)


def encode_batch(events, start: StreamStart | None = None) -> bytes:
    """One stream's events of a step (and its start, on its first record) as one record's bytes."""
    out: list = [None if start is None else (start.prompt_tail, start.input_length, start.seed)]
    for e in events:
        if isinstance(e, ErrorEvent):
            out.append((e.message, e.error_type))
        else:
            out.append((e.index, e.token_id, e.logprob, e.special, e.top, e.prefill, _finish_wire(e.finish)))
    return _encoder.encode(out)


def decode_batch(data: bytes) -> tuple[StreamStart | None, list[TokenEvent | ErrorEvent]]:
    """The inverse of `encode_batch` (text fields empty: the router's renderer fills them);
    `ValueError` for bytes that are not such a record."""
    try:
        value = _decoder.decode(data)
        start = value[0]
        events: list[TokenEvent | ErrorEvent] = []
        for item in value[1:]:
            if len(item) == 2:
                events.append(ErrorEvent(item[0], item[1]))
                continue
            index, token_id, logprob, special, top, prefill, f = item
            finish = None if f is None else FinishInfo(f[0], "", f[1], f[2], f[3], None, f[4])
            events.append(TokenEvent(index, token_id, "", logprob, special, finish,
                                     None if top is None else tuple(map(tuple, top)),
                                     None if prefill is None else tuple(_prefill_entry(p) for p in prefill)))
        head = None if start is None else StreamStart(tuple(start[0]), start[1], start[2])
    except (msgspec.DecodeError, TypeError, IndexError) as e:
        raise ValueError(f"not a stream channel record: {e}") from None
    return head, events


def _prefill_entry(p) -> tuple:
    token_id, logprob, top = p
    return token_id, logprob, None if top is None else tuple(map(tuple, top))
