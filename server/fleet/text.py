"""The text of a worker's streams, built in the router: prompts in, detokenization, stop strings
and TGI's events out.

Design: a worker's stream channel opened for token ids (workers/contract/events.py) sends each
step's token ids, logprobs and finish; the router holds the worker's tokenizer (`TextModel`, made
once per distinct `GET /tokenizer` answer, with `tokenizers` and llguidance, neither needing
torch), tokenizes the prompt before dispatch, and per stream (`StreamText`) runs the same
incremental detokenizer and stop-string rules the engine ran (workers/contract/detokenize.py) and
renders the same `/generate_stream` events (workers/contract/render.py). So the engine's
interpreter does no text work at all, and what a client receives is byte for byte what the
worker would have rendered. A stop string is found here: the stream's last event is built here,
and the worker's request is aborted (it may have computed a step or two more, which are
dropped), as vLLM's output processor does. Trade-off: each stream costs the router a
detokenizer and a JSON render per step, work the router's event loop now shares with HTTP, but
it no longer competes with the engine's steps for one interpreter.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass

import llguidance
from tokenizers import Tokenizer

from workers.contract import WorkerRequest
from workers.contract.detokenize import IncrementalDetokenizer, TokenBytes, special_token_ids
from workers.contract.errors import ERROR_VALIDATION, safe_message
from workers.contract.events import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    ErrorEvent,
    FinishInfo,
    StreamStart,
    TokenEvent,
)
from workers.contract.render import Render, error_frame

INLINE_PROMPT_CHARS = 4096  # longer prompts are tokenized off the event loop
# longer prompts go as text: the worker, which knows its context, refuses one that cannot fit
# before tokenizing it (workers/serving/context.py), and tokenizes the others off its event loop
MAX_ROUTER_PROMPT_CHARS = 1 << 16


class TextModel:
    """One tokenizer as its workers use it: encode, decode, special ids and each token's bytes."""

    def __init__(self, tokenizer_json: str, vocab_size: int):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = vocab_size
        self.special_ids = special_token_ids(self.tokenizer)
        self._json = tokenizer_json
        self._bytes: TokenBytes | None = None
        self._lock = threading.Lock()

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's raw bytes (llguidance's, as the worker's), made when first needed: only
        logprobs ask."""
        if self._bytes is None:
            with self._lock:
                if self._bytes is None:
                    decode = llguidance.LLTokenizer(self._json, n_vocab=self.vocab_size).decode_bytes
                    self._bytes = TokenBytes(decode, self.special_ids)
        return self._bytes


_models: dict[str, TextModel] = {}  # by the digest of the tokenizer's JSON and the vocabulary size


async def text_model(tokenizer_json: bytes, vocab_size: int) -> TextModel:
    """The `TextModel` of this tokenizer, made off the event loop the first time it is seen."""
    key = hashlib.sha256(tokenizer_json).hexdigest() + f":{vocab_size}"
    model = _models.get(key)
    if model is None:
        model = await asyncio.to_thread(TextModel, tokenizer_json.decode(), vocab_size)
        _models[key] = model
    return model


async def with_prompt_ids(model: TextModel, req: WorkerRequest) -> WorkerRequest:
    """`req` with its text prompt as token ids, tokenized as the worker would (special tokens
    added); unchanged when it gives ids already, has no text, or a text longer than
    `MAX_ROUTER_PROMPT_CHARS` (the worker refuses one that cannot fit before tokenizing it)."""
    text = req.inputs
    if req.input_ids is not None or not text or len(text) > MAX_ROUTER_PROMPT_CHARS:
        return req
    encode = model.tokenizer.encode
    ids = (await asyncio.to_thread(encode, text) if len(text) > INLINE_PROMPT_CHARS else encode(text)).ids
    if not ids:
        return req  # the worker says why an empty prompt is refused
    return req.model_copy(update={"inputs": "", "input_ids": tuple(ids)})


@dataclass
class StreamText:
    """One stream's text: feed it each record's `(start, events)`; it answers the SSE text and
    whether the stream ended (its finish, an error, or a stop string found here)."""

    model: TextModel
    request: WorkerRequest  # as the client's edge made it (its text prompt, not the ids sent)
    detok: IncrementalDetokenizer | None = None
    render: Render | None = None
    start: StreamStart | None = None
    ended: bool = False

    def _begin(self, start: StreamStart) -> None:
        p, model = self.request.parameters, self.model
        self.start = start
        self.detok = IncrementalDetokenizer(model.tokenizer, list(start.prompt_tail), model.special_ids, p.stop,
                                            p.include_stop_str_in_output, p.skip_special_tokens, p.min_tokens)
        for token_id in self.request.resume_ids:  # their text reached the client already: the state only
            self.detok.add(token_id)
        given = self.request.input_ids
        input_text = None if given is None else model.tokenizer.decode(list(given), skip_special_tokens=True)
        prefix = (self.request.inputs or input_text or "") if p.return_full_text else ""
        tokens = model.token_bytes if _wants_bytes(p) else _NoBytes(model.special_ids)
        self.render = Render(tokens, p, prefix, input_text)

    def events(self, start: StreamStart | None, events: list) -> tuple[list, bool]:
        """A record's events with their text (up to the stream's last), and whether it ended."""
        if start is not None and self.detok is None:
            self._begin(start)
        if self.ended:
            return [], True
        if self.detok is None:
            raise ValueError("a stream's first record carried no start")
        out = []
        for e in events:
            event = e if isinstance(e, ErrorEvent) else self._text(e)
            out.append(event)
            if isinstance(event, ErrorEvent) or event.finish is not None:
                self.ended = True
                break
        return out, self.ended

    def feed(self, start: StreamStart | None, events: list) -> tuple[str, bool]:
        """A record's events as the SSE text `/generate_stream` sends, and whether it ended."""
        done, ended = self.events(start, events)
        render = self.render
        return "".join(error_frame(e.message, e.error_type) if isinstance(e, ErrorEvent)
                       else f"data: {json.dumps(render.event(e))}\n\n" for e in done), ended

    def answer(self, events: list) -> tuple[int, bytes]:
        """`/generate`'s status and body from a whole stream's events (with their text)."""
        last = events[-1]
        if isinstance(last, ErrorEvent):  # the request's fault, or the engine's (as the worker answers)
            status = 422 if last.error_type == ERROR_VALIDATION else 500
            return status, _json({"error": safe_message(last.message), "error_type": last.error_type})
        p = self.request.parameters
        return 200, _json(self.render.response(events, p.details or p.decoder_input_details))

    def _text(self, e: TokenEvent) -> TokenEvent:
        """The worker's event with its text, and its finish as the engine would have made it with
        the text: a stop string found here ends it (workers/engine/output.py, the same rules)."""
        p, detok, worker_finish = self.request.parameters, self.detok, e.finish
        reason = None if worker_finish is None else worker_finish.reason
        if reason in (FINISH_EOS, FINISH_STOP) and not p.include_stop_str_in_output and (
                not p.skip_special_tokens or not detok.is_special(e.token_id)):
            text, special = "", False  # the EOS or stop token id that ends it, left out of the text
        else:
            text, special = detok.add(e.token_id)
        if reason == FINISH_LENGTH and self.request.publish_kv:
            reason = None  # a prefill handed off after its first token: another worker goes on (no end here)
        if detok.stopped:
            reason = FINISH_STOP
        finish = None
        if reason is not None:
            text += detok.flush()
            stop_reason = None
            if reason == FINISH_STOP:
                stop_reason = detok.stop_hit if detok.stopped else worker_finish.stop_reason
            length, seed = self.start.input_length, self.start.seed
            if worker_finish is not None:
                length, seed = worker_finish.input_length, worker_finish.seed
            finish = FinishInfo(reason, detok.text, e.index + 1, length, seed, None, stop_reason)
        return TokenEvent(e.index, e.token_id, text, e.logprob, special, finish, e.top, e.prefill)


def _json(value) -> bytes:
    """As the worker's JSON responses are written (Starlette's `JSONResponse`)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _wants_bytes(p) -> bool:
    """Whether the answer names tokens' own bytes or text: logprobs, or the prompt's entries."""
    return p.top_n_tokens is not None or p.prompt_top_n_tokens is not None or p.decoder_input_details


class _NoBytes:
    """Stands in for `TokenBytes` when the answer names no token's own bytes (most streams), so
    the llguidance tokenizer is made only for the requests that need it."""

    def __init__(self, special_ids: frozenset[int]):
        self.special_ids = special_ids
