"""What every route of the worker's app needs, and the one way a generation request gets in.

Design: `WorkerContext` holds the worker's fixed description (its `/capability` answer), the
engine, the tokenizer with its grammar engine and token bytes, the request tracer and the HTTP
side's state (`starting`, `ready`, `draining`); routes take it through `get_ctx`, as the router's
routes do. `submit` is the worker's admission, cheapest check first, each refusal an `APIError`
naming the field: the parameters; the prompt (one that cannot fit whatever its tokens is refused
before tokenizing, a long one tokenized off the event loop); the vocabulary and the context; then
the grammar, compiled under its budget and abandoned if the client leaves; then the queue.
Trade-off: the order is by cost, not by what a client would fix first, so a request with several
faults hears of the cheapest one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from workers.contract import CapabilityPayload, WorkerRequest
from workers.contract.detokenize import PROMPT_CONTEXT_TOKENS, TokenBytes
from workers.contract.events import StreamStart
from workers.contract.render import Render
from workers.engine.core import Engine, EngineOverloaded, EngineUnavailable
from workers.engine.events import RequestStream
from workers.engine.scheduler import CapacityError
from workers.lora.adapter import LoraError
from workers.lora.table import UnknownLora
from workers.sampling.grammar import CompiledGrammar, GrammarBusy, GrammarError, Grammars, GrammarSpec
from workers.sampling.params import ParameterError, SamplingParams
from workers.serving.errors import APIError
from workers.serving.tracing import RequestTracer

CLIENT_GONE = "client_disconnected"  # the error type that ends a request whose client left
_INLINE_CHARS = 4096  # longer prompt texts are tokenized off the event loop

@dataclass(frozen=True)
class Submitted:
    """A queued request: its stream, its parameters, how its answer renders, its span (or None)
    and, when the router renders it, its `StreamStart`."""

    stream: RequestStream
    params: SamplingParams
    render: Render | None  # None: the router renders (a stream on an `ids` channel)
    span: Any = None
    start: StreamStart | None = None  # what the router's renderer needs first (an `ids` channel's stream)


@dataclass(eq=False)
class WorkerContext:
    info: CapabilityPayload  # `/capability` but for `pid`, `load` and the free KV blocks
    engine: Engine
    tokenizer: Any  # tokenizers.Tokenizer
    grammars: Grammars
    token_bytes: TokenBytes
    tracer: RequestTracer
    status: str = field(default="starting")  # starting | ready | draining
    channels: dict = field(default_factory=dict)  # id -> the router's `StreamChannel`s (workers/serving/channel.py)
    stopping: Callable[[], bool] = field(default=lambda: False)  # the HTTP server is shutting down
    tokenizer_json: bytes | None = None  # `GET /tokenizer`'s answer (made when first asked)
    _max_token_chars: int | None = None  # the most characters one token stands for (found when first needed)

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self.engine.accepting

    async def submit(self, req: WorkerRequest, request: Request | None = None, text: bool = True) -> Submitted:
        """Validate, tokenize, compile the grammar and queue (see the module docstring); every
        refusal is an `APIError`. `request`: the HTTP request, watched for the client leaving
        while its grammar compiles; `text` False: the router builds the answer's text and frames
        from its token ids (no text here, no stop strings, no rendering)."""
        if not self.ready:
            raise APIError(503, f"Worker `{self.info.worker_id}` is {self.status}: not accepting requests",
                           "unavailable")
        engine, vocab = self.engine, self.grammars.vocab_size
        try:
            params = SamplingParams.from_request(req.parameters)
            prompt_ids, input_text = await self._prompt_ids(req, params.context_tokens, text)
            _check_vocab(params, vocab)
            engine.scheduler.check_fits(len(prompt_ids), params.context_tokens)  # before any compile
            grammar = None if params.grammar is None else await self._compiled(params.grammar, request)
            stream = engine.submit(prompt_ids, params, asyncio.get_running_loop(), grammar=grammar,
                                   resume_ids=req.resume_ids, text=text, lora=req.lora,
                                   publish_kv=req.publish_kv)
            if not text:
                start = StreamStart(tuple(prompt_ids[-PROMPT_CONTEXT_TOKENS:]), len(prompt_ids), stream.seed)
                return Submitted(stream, params, None, start=start)
            prefix = (req.inputs or input_text or "") if req.parameters.return_full_text else ""
            return Submitted(stream, params, Render(self.token_bytes, req.parameters, prefix, input_text))
        except (ParameterError, CapacityError, GrammarError) as e:
            engine.metrics.rejected.labels("validation").inc()
            raise APIError(422, str(e), "validation") from e
        except (EngineOverloaded, GrammarBusy) as e:
            retry = str(getattr(e, "retry_after", 1))
            raise APIError(429, str(e), "overloaded", {"Retry-After": retry}) from e
        except EngineUnavailable as e:
            raise APIError(503, str(e), "unavailable") from e
        except LoraError as e:  # an adapter not served here (404) or unreadable (422)
            raise lora_error(e) from e

    async def _compiled(self, spec: GrammarSpec, request: Request | None) -> CompiledGrammar:
        """The compiled grammar, or `APIError` 499 when the client left while it compiled (the
        compile is then cancelled unless another request waits for it)."""
        hit = self.grammars.cached(spec)
        if hit is not None or request is None:
            return hit or await self.grammars.compile_async(spec)
        compiling = asyncio.ensure_future(self.grammars.compile_async(spec))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait((compiling, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not compiling.done():
                compiling.cancel()
        if not compiling.done() or compiling.cancelled():
            raise APIError(499, "The client disconnected while its grammar compiled", CLIENT_GONE)
        return compiling.result()

    async def _prompt_ids(self, req: WorkerRequest, new_tokens: int, decode: bool) -> tuple[list[int], str | None]:
        """The prompt's token ids (and, with `decode`, what given ids decode to); a text that
        cannot fit the context whatever its tokens is refused untokenized (`CapacityError`), a
        long one tokenized off the event loop."""
        text = req.inputs
        if req.input_ids is None and text and len(text) > _INLINE_CHARS:
            if self._max_token_chars is None:
                self._max_token_chars = await asyncio.to_thread(_max_token_chars, self.grammars.tokenizer.decode_bytes,
                                                                self.grammars.vocab_size)
            least = len(text) // (2 * self._max_token_chars)  # halved: a normalizer may merge characters
            limit = self.engine.scheduler.config.max_seq_len
            if least + new_tokens > limit:
                raise CapacityError(f"`inputs` holds {len(text)} characters, at least {least} tokens: "
                                    f"`inputs` tokens + `max_new_tokens` must be <= {limit} on this worker")
            return await asyncio.to_thread(_prompt_ids, req, self.tokenizer, self.grammars.vocab_size, decode)
        return _prompt_ids(req, self.tokenizer, self.grammars.vocab_size, decode)

    async def submit_traced(self, req: WorkerRequest, request: Request, text: bool = True) -> Submitted:
        """`submit` inside the request's span (a child of the router's); a refusal ends the span."""
        span = self.tracer.start(request.url.path, request.headers)
        try:
            submitted = await self.submit(req, request, text)
        except APIError as e:
            self.tracer.end(span, None, refused=e.message)
            raise
        return replace(submitted, span=span)


def get_ctx(request: Request) -> WorkerContext:
    """The route dependency: this app's `WorkerContext`."""
    return request.app.state.ctx


def _prompt_ids(req: WorkerRequest, tokenizer, vocab_size: int, text: bool = True) -> tuple[list[int], str | None]:
    """The prompt's token ids, and the text they decode to when the request gave ids (and `text`)."""
    if req.input_ids is None:
        if not req.inputs:
            raise ParameterError("`inputs` must be a non-empty string (or give `input_ids`)")
        return tokenizer.encode(req.inputs).ids, None
    bad = [t for t in req.input_ids if not 0 <= t < vocab_size]
    if not req.input_ids or bad:
        raise ParameterError(f"`input_ids` must be a non-empty list of token ids in [0, {vocab_size - 1}]"
                             + (f", got `{bad[0]}`" if bad else ""))
    return list(req.input_ids), tokenizer.decode(req.input_ids, skip_special_tokens=True) if text else None


async def client_gone(request: Request) -> None:
    """Returns once the client has gone away (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _max_token_chars(decode_bytes, vocab_size: int) -> int:
    """The most bytes (so at most that many characters) any one token of the vocabulary decodes to."""
    return max(1, max((len(decode_bytes([i])) for i in range(vocab_size)), default=1))


def _check_vocab(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ParameterError(f"`logit_bias` token id `{bad[0]}` is outside the vocabulary (0 to {vocab_size - 1})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ParameterError(f"`stop_token_ids` token id `{bad[0]}` is outside the vocabulary (0 to {vocab_size - 1})")


def lora_error(e: LoraError) -> APIError:
    """The answer to a request whose adapter cannot run: not served here (404, OpenAI's
    `model_not_found`) or unreadable now (422). With every slot in use it is not refused: it waits
    in the worker's queue for one (workers/lora/waiting.py)."""
    if isinstance(e, UnknownLora):
        return APIError(404, str(e), "model_not_found")
    return APIError(422, str(e), "validation")
