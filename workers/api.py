"""The worker's HTTP API on its Unix socket: what the router (and only the router) calls.

Routes: POST /generate, POST /generate_stream (SSE), GET /health, GET /capability,
GET /metrics — TGI shapes, errors as `{"error", "error_type"}` (422 validation, 429
overloaded with Retry-After, 503 unavailable, 500 internal). Every response carries
X-Worker-Id, X-Worker-Capability and X-Fp8-Convention (added by a pure ASGI middleware,
so streamed responses get them too and no route can forget them).

Design: `create_app()` is a factory over a ready engine (no model work at import).
`/capability` is the worker's fixed description plus what changes: its load and its free
KV blocks. The
engine thread starts in the lifespan and stops there. A request is tokenized and validated
here, so a bad one is answered before it takes a queue place; the route then only awaits
its `RequestStream`. A client that goes away is noticed by a task waiting for
`http.disconnect` (non-streamed), which also ends the request's stream, or by Starlette
cancelling the stream (streamed); both abort the request, which frees its KV blocks before
the next engine step. `/health` reports the engine's liveness (pending work, age of its last
step) beside the HTTP side's state, so the router can tell a hung engine from an idle one,
and the KV cache's free blocks; a request's `resume_ids` continues a stream another worker
began.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from workers.contract import (
    DRAIN_TIMEOUT_S,
    HEADER_FP8_CONVENTION,
    HEADER_WORKER_CAPABILITY,
    HEADER_WORKER_ID,
    CapabilityPayload,
)
from workers.contract.payload import EngineLiveness, HealthPayload, Load
from workers.contract.tracing import NO_TRACING, Tracing, fastapi_telemetry_off
from workers.detokenize import special_token_ids
from workers.engine import Engine, EngineOverloaded, EngineUnavailable, ErrorEvent, RequestStream
from workers.grammar import GrammarError, Grammars
from workers.logprobs import TokenBytes
from workers.metrics import CONTENT_TYPE
from workers.request_trace import RequestTracer
from workers.sampling import ParameterError, SamplingParams
from workers.scheduler import CapacityError
from workers.schemas import GenerateRequest, Render

logger = logging.getLogger(__name__)

CLIENT_GONE = "client_disconnected"  # the error type that ends a stream whose client left


def identity_headers(info: CapabilityPayload) -> dict[str, str]:
    """X-Worker-Id, X-Worker-Capability ("9.0" or "cpu") and X-Fp8-Convention of this worker."""
    return {
        HEADER_WORKER_ID: info.worker_id or "",
        HEADER_WORKER_CAPABILITY: info.device.capability or "cpu",
        HEADER_FP8_CONVENTION: info.fp8.convention or "",
    }


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers


def error_response(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)


class WorkerHeaders:
    """Pure ASGI middleware: the worker's identity headers on every HTTP response."""

    def __init__(self, app, headers: dict[str, str]):
        self.app = app
        self.raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.raw]}
            await send(message)

        return await self.app(scope, receive, send_with_headers)


def _field_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"`{loc}`: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


async def _abort_on_disconnect(request: Request, engine: Engine, stream: RequestStream) -> None:
    """Waits until the client goes away (the body has already been read), then aborts its
    request and ends its stream."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(stream.request_id)
    stream.push(ErrorEvent("The client disconnected", CLIENT_GONE))


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


def _check_vocab(params, vocab_size: int) -> None:
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ParameterError(f"`logit_bias` token id `{bad[0]}` is outside the vocabulary (0 to {vocab_size - 1})")


def create_app(info: CapabilityPayload, engine: Engine, tokenizer, *, drain_timeout: float = DRAIN_TIMEOUT_S,
               tracing: Tracing = NO_TRACING) -> FastAPI:
    """The worker's app over a ready engine; `info` is its `/capability` answer but for `pid`
    and `load`, which are filled in per request. `tracing`: one span per generation request.
    The engine's grammar engine compiles constrained requests (made from `tokenizer` when the
    engine has none)."""
    state = {"status": "starting"}
    tracer = RequestTracer(tracing, info)
    if engine.grammars is None:
        engine.grammars = Grammars.for_tokenizer(tokenizer, None, engine.scheduler.config.eos_token_ids)
    grammars = engine.grammars
    token_bytes = TokenBytes(grammars.tokenizer.decode_bytes, special_token_ids(tokenizer))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        state["status"] = "ready"
        try:
            yield
        finally:
            state["status"] = "draining"
            await asyncio.to_thread(engine.shutdown, drain_timeout)

    app = FastAPI(title="hetserve worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  **fastapi_telemetry_off())
    app.add_middleware(WorkerHeaders, headers=identity_headers(info))
    app.state.worker = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.error_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, _field_message(exc), "validation")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("Unhandled error on %s", request.url.path)
        return error_response(500, "Internal error in the worker; see its log", "internal")

    async def submit(req: GenerateRequest) -> tuple[RequestStream, SamplingParams, Render]:
        """Tokenize, validate, compile the grammar (cached; off the event loop) and queue;
        every refusal is an `APIError`."""
        if state["status"] != "ready" or not engine.accepting:
            raise APIError(503, f"Worker `{info.worker_id}` is {state['status']}: not accepting requests", "unavailable")
        try:
            params = req.parameters.sampling()
            prompt_ids, input_text = _prompt_ids(req, tokenizer, grammars.vocab_size)
            _check_vocab(params, grammars.vocab_size)
            grammar = None if params.grammar is None else await asyncio.to_thread(grammars.compile, params.grammar)
            stream = engine.submit(prompt_ids, params, asyncio.get_running_loop(), grammar=grammar,
                                   resume_ids=req.resume_ids)
            prefix = (req.inputs or input_text or "") if req.parameters.return_full_text else ""
            return stream, params, Render(token_bytes, req.parameters, prefix, input_text)
        except (ParameterError, CapacityError, GrammarError) as e:
            engine.metrics.rejected.labels("validation").inc()
            raise APIError(422, str(e), "validation") from e
        except EngineOverloaded as e:
            raise APIError(429, str(e), "overloaded", {"Retry-After": str(e.retry_after)}) from e
        except EngineUnavailable as e:
            raise APIError(503, str(e), "unavailable") from e

    async def submit_traced(req: GenerateRequest, request: Request):
        """`submit` inside the request's span: (stream, params, render, span); a refusal ends the span."""
        span = tracer.start(request.url.path, request.headers)
        try:
            stream, params, render = await submit(req)
        except APIError as e:
            tracer.end(span, None, refused=e.message)
            raise
        return stream, params, render, span

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        stream, params, render, span = await submit_traced(req, request)
        # a request an idle engine finished within submit() has nothing left to abort
        watcher = None if stream.ended else asyncio.ensure_future(_abort_on_disconnect(request, engine, stream))
        events = []
        try:
            async for e in stream:
                events.append(e)
        finally:
            if watcher is not None:
                watcher.cancel()
            last = events[-1] if events else None
            if last is None or not (isinstance(last, ErrorEvent) or last.finish is not None):
                engine.abort(stream.request_id)  # this handler was cancelled mid-request
            gone = last is None or (isinstance(last, ErrorEvent) and last.error_type == CLIENT_GONE)
            tracer.end(span, None if gone else last, stream.request_id, params)
        if isinstance(events[-1], ErrorEvent):
            if events[-1].error_type == CLIENT_GONE:
                return Response(status_code=499)
            return error_response(500, events[-1].message, events[-1].error_type)
        return JSONResponse(render.response(events, req.parameters.details or req.parameters.decoder_input_details))

    @app.post("/generate_stream")
    async def generate_stream(req: GenerateRequest, request: Request):
        if req.parameters.scoring_only:
            raise APIError(422, "`max_new_tokens` must be an integer >= 1 on `/generate_stream` "
                                "(0, prompt scoring, is answered by `/generate`)", "validation")
        stream, params, render, span = await submit_traced(req, request)

        async def sse():
            finished, e = False, None
            try:
                async for e in stream:
                    if isinstance(e, ErrorEvent):
                        finished = True
                        yield f"data: {json.dumps({'error': e.message, 'error_type': e.error_type})}\n\n"
                        return
                    finished = e.finish is not None
                    yield f"data: {json.dumps(render.event(e))}\n\n"
            finally:
                if not finished:  # cancelled: the client went away mid-stream
                    engine.abort(stream.request_id)
                tracer.end(span, e if finished else None, stream.request_id, params)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        running, queued = engine.load()
        ok = state["status"] == "ready" and engine.accepting
        status = "ready" if ok else ("starting" if state["status"] == "starting" else "draining")
        live = engine.liveness()
        body = HealthPayload(status=status, worker_id=info.worker_id, load=Load(running=running, queued=queued),
                             engine=EngineLiveness(pending=live.pending, last_step_age_s=round(live.last_step_age_s, 3),
                                                   steps=live.steps),
                             capacity=engine.kv_now())
        return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)

    @app.get("/capability")
    async def capability():
        running, queued = engine.load()
        now = info.model_copy(update={"pid": os.getpid(), "load": Load(running=running, queued=queued),
                                      "capacity": {**info.capacity, **engine.kv_now()}})
        return now.model_dump(mode="json", exclude={"deterministic"} if info.deterministic is None else None)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app
