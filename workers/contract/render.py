"""The worker's answers in TGI's shapes, from the engine's events.

A request arrives as the contract's `WorkerRequest` (workers/contract/request.py) and never
changes shape; its answer is built here as plain dicts from the engine's `TokenEvent` /
`FinishInfo`, which is cheaper per streamed token than a pydantic model. Beyond TGI's fields:
`input_text` (what `input_ids` decode to), `details.stop_reason` (which stop string or stop
token id ended an answer), and with `top_n_tokens` set (0 included) each token's and each
alternative's own `bytes` (a token's `text` in a stream is its streamed piece, which may hold
back half a character), so the router can build OpenAI logprobs.
"""

from __future__ import annotations

import json
from dataclasses import replace

from workers.contract.detokenize import TokenBytes
from workers.contract.errors import safe_message
from workers.contract.events import FinishInfo, TokenEvent, TopList, finite
from workers.contract.request import GenerationParameters


class Render:
    """Turns one request's engine events into TGI dicts (with the extensions above)."""

    __slots__ = ("tokens", "logprobs", "prefix", "input_text", "scoring_only")

    def __init__(self, tokens: TokenBytes, params: GenerationParameters, prefix: str, input_text: str | None):
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


def error_frame(message: str, error_type: str) -> str:
    """A stream's error event, as either side writes it."""
    return f"data: {json.dumps({'error': safe_message(message), 'error_type': error_type})}\n\n"
