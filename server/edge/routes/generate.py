"""TGI-shaped generation: `POST /generate`, `POST /generate_stream` (SSE), `POST /`, `GET /info`.

The public request is translated once into the contract's `WorkerRequest` (the same TGI names),
the router picks a worker and relays the answer bytes untouched (the worker answers in TGI's
shapes), adding the worker headers. `POST /` is TGI's compat route (what `huggingface_hub.InferenceClient`
calls when given the server's URL): `"stream": true` streams, otherwise it generates. The
`X-Hetserve-Model` header picks the model (absent: the default model).
A stream the worker loses after its first event moves to another worker from the token
it reached (server/dispatch/migration.py); one that no worker can continue ends with
`data: {"error": ..., "error_type": "incomplete_generation"}` (what TGI clients raise as
an incomplete generation).
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.dispatch.dispatcher import WorkerReply
from server.dispatch.migration import ClientStream, StreamIncomplete, StreamRefused, open_client_stream
from server.edge.context import VERSION, ModelContext, get_ctx
from server.edge.routes._common import (
    RelayResponse,
    check_new_tokens,
    close_shielded,
    constraints,
    tgi_model,
    to_worker,
)
from server.protocol.tgi import ErrorResponse, GenerateRequest, GenerateResponse
from workers.contract import MAX_STOP_SEQUENCES, WorkerRequest

logger = logging.getLogger(__name__)
router = APIRouter(tags=["text-generation-inference"])

_ERRORS = {code: {"model": ErrorResponse} for code in (401, 413, 422, 429, 503)}
_STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events, one per token"}}


def _reply(reply: WorkerReply) -> Response:
    return Response(reply.content, status_code=reply.status, media_type="application/json", headers=reply.headers)


def _worker_request(req: GenerateRequest, ctx: ModelContext) -> WorkerRequest:
    check_new_tokens(ctx, req.parameters.max_new_tokens, "parameters.max_new_tokens")
    return to_worker(req.to_worker)


async def _generate(req: GenerateRequest, request: Request) -> Response:
    ctx = tgi_model(request)
    reply = await ctx.dispatcher.generate("/generate", _worker_request(req, ctx), constraints(request, model=ctx))
    return _reply(reply)


async def _generate_stream(req: GenerateRequest, request: Request) -> Response:
    ctx = tgi_model(request)
    opened = await open_client_stream(ctx.dispatcher, "/generate_stream", _worker_request(req, ctx),
                                      constraints(request, model=ctx))
    if isinstance(opened, WorkerReply):
        return _reply(opened)
    return RelayResponse(relay_tgi(opened, ctx), opened)


async def relay_tgi(stream: ClientStream, ctx: ModelContext):
    """The workers' event bytes as they come; an error event if no worker can finish the stream."""
    try:
        async for raw in stream.batches():
            yield raw
        return
    except StreamIncomplete as e:
        logger.warning("stream ends incomplete: %s", e)
        error, kind, refused = str(e), e.error_type, isinstance(e, StreamRefused)
    finally:
        await close_shielded(stream)
    if not refused:  # a refusal of the request (its grammar cannot end) is no stream error of the worker's
        ctx.metrics.stream_error(stream.worker)
    yield f"data: {json.dumps({'error': error, 'error_type': kind})}\n\n".encode()


@router.post("/generate", response_model=None, responses={200: {"model": GenerateResponse}, **_ERRORS})
async def generate(req: GenerateRequest, request: Request) -> Response:
    """Generate text for `inputs` (TGI shape); the answer carries the worker headers."""
    return await _generate(req, request)


@router.post("/generate_stream", response_model=None, responses={**_STREAM_DOC, **_ERRORS})
async def generate_stream(req: GenerateRequest, request: Request) -> Response:
    """Generate text token by token as Server-Sent Events (TGI shape)."""
    return await _generate_stream(req, request)


@router.post("/", response_model=None, responses={200: {"model": GenerateResponse}, **_ERRORS})
async def compat_generate(req: GenerateRequest, request: Request) -> Response:
    """TGI's compat route: streams when `stream` is true, else like `/generate`."""
    return await (_generate_stream(req, request) if req.stream else _generate(req, request))


@router.get("/info")
async def info(request: Request) -> dict:
    """Model and router facts (TGI's `/info`, trimmed to what this server knows)."""
    ctx = get_ctx(request)
    return {
        "model_id": ctx.model_id(),
        "max_total_tokens": ctx.context_length(),
        "max_best_of": 1,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_concurrent_requests": ctx.settings.worker_capacity * max(1, len(ctx.supervisor.workers)),
        "version": VERSION,
        "router": "hetserve",
        "workers": len(ctx.supervisor.workers),
    }
