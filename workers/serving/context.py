"""What every route of the worker's app needs, and the one way a generation request gets in.

`WorkerContext` holds the worker's fixed description (its `/capability` answer), the engine,
the tokenizer with its grammar engine and token bytes, the request tracer and the HTTP side's
own state (`starting` until the lifespan has started the engine, `ready`, `draining`).
`create_app` puts one on `app.state.ctx`; routes take it through `get_ctx`, as the router's
routes do. `submit` is the worker's admission: tokenize, validate (every refusal an
`APIError` naming the field), compile the grammar off the event loop (cached) and queue, so a
bad request is answered before it takes a queue place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from workers.contract import CapabilityPayload
from workers.engine.core import Engine, EngineOverloaded, EngineUnavailable
from workers.engine.events import RequestStream
from workers.engine.scheduler import CapacityError
from workers.sampling.grammar import GrammarError, Grammars
from workers.sampling.logprobs import TokenBytes
from workers.sampling.params import ParameterError, SamplingParams
from workers.serving.errors import APIError
from workers.serving.schemas import GenerateRequest, Render
from workers.serving.tracing import RequestTracer


@dataclass(frozen=True)
class Submitted:
    """A queued request: its stream, its parameters, how its answer renders, its span (or None)."""

    stream: RequestStream
    params: SamplingParams
    render: Render
    span: Any = None


@dataclass(eq=False)
class WorkerContext:
    info: CapabilityPayload  # `/capability` but for `pid`, `load` and the free KV blocks
    engine: Engine
    tokenizer: Any  # tokenizers.Tokenizer
    grammars: Grammars
    token_bytes: TokenBytes
    tracer: RequestTracer
    status: str = field(default="starting")  # starting | ready | draining

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self.engine.accepting

    async def submit(self, req: GenerateRequest) -> Submitted:
        """Tokenize, validate, compile the grammar and queue; every refusal is an `APIError`."""
        if not self.ready:
            raise APIError(503, f"Worker `{self.info.worker_id}` is {self.status}: not accepting requests",
                           "unavailable")
        engine, vocab = self.engine, self.grammars.vocab_size
        try:
            params = req.parameters.sampling()
            prompt_ids, input_text = _prompt_ids(req, self.tokenizer, vocab)
            _check_vocab(params, vocab)
            grammar = None if params.grammar is None else await asyncio.to_thread(self.grammars.compile, params.grammar)
            stream = engine.submit(prompt_ids, params, asyncio.get_running_loop(), grammar=grammar,
                                   resume_ids=req.resume_ids)
            prefix = (req.inputs or input_text or "") if req.parameters.return_full_text else ""
            return Submitted(stream, params, Render(self.token_bytes, req.parameters, prefix, input_text))
        except (ParameterError, CapacityError, GrammarError) as e:
            engine.metrics.rejected.labels("validation").inc()
            raise APIError(422, str(e), "validation") from e
        except EngineOverloaded as e:
            raise APIError(429, str(e), "overloaded", {"Retry-After": str(e.retry_after)}) from e
        except EngineUnavailable as e:
            raise APIError(503, str(e), "unavailable") from e

    async def submit_traced(self, req: GenerateRequest, request: Request) -> Submitted:
        """`submit` inside the request's span (a child of the router's); a refusal ends the span."""
        span = self.tracer.start(request.url.path, request.headers)
        try:
            submitted = await self.submit(req)
        except APIError as e:
            self.tracer.end(span, None, refused=e.message)
            raise
        return Submitted(submitted.stream, submitted.params, submitted.render, span)


def get_ctx(request: Request) -> WorkerContext:
    """The route dependency: this app's `WorkerContext`."""
    return request.app.state.ctx


def _prompt_ids(req: GenerateRequest, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """The prompt's token ids, and the text they decode to when the request gave ids."""
    if req.input_ids is None:
        if not req.inputs:
            raise ParameterError("`inputs` must be a non-empty string (or give `input_ids`)")
        return tokenizer.encode(req.inputs).ids, None
    if req.inputs:
        raise ParameterError("Give the prompt as `inputs` or as `input_ids`, not both")
    bad = [t for t in req.input_ids if not 0 <= t < vocab_size]
    if not req.input_ids or bad:
        raise ParameterError(f"`input_ids` must be a non-empty list of token ids in [0, {vocab_size - 1}]"
                             + (f", got `{bad[0]}`" if bad else ""))
    return list(req.input_ids), tokenizer.decode(req.input_ids, skip_special_tokens=True)


def _check_vocab(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ParameterError(f"`logit_bias` token id `{bad[0]}` is outside the vocabulary (0 to {vocab_size - 1})")
