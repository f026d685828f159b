"""`POST /generate` and `POST /generate_stream` (SSE), in TGI's shapes.

A request is admitted by the context (tokenized, validated, queued), then the route only
awaits its `RequestStream`. A client that goes away is noticed by a task waiting for
`http.disconnect` (non-streamed), which also ends the request's stream, or by Starlette
cancelling the stream (streamed); both abort the request, which frees its KV blocks before
the next engine step. Each request has one span, ended with what happened to it. A raise
while rendering a stream's events is this request's fault alone: its stream ends with a
`request_failed` error event (never a broken connection, which the router would read as the
worker's death) and the worker serves on.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from workers.contract.errors import ERROR_REQUEST_FAILED, ERROR_VALIDATION, safe_message
from workers.engine.core import Engine
from workers.engine.events import ErrorEvent, RequestStream, is_last
from workers.serving.context import CLIENT_GONE, get_ctx
from workers.serving.errors import APIError, error_response
from workers.serving.schemas import GenerateRequest

router = APIRouter()
logger = logging.getLogger(__name__)


def _error_frame(message: str, error_type: str) -> str:
    return f"data: {json.dumps({'error': safe_message(message), 'error_type': error_type})}\n\n"


async def _abort_on_disconnect(request: Request, engine: Engine, stream: RequestStream) -> None:
    """Waits until the client goes away (the body has already been read), then aborts its
    request and ends its stream."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(stream.request_id)
    stream.push(ErrorEvent("The client disconnected", CLIENT_GONE))


@router.post("/generate")
async def generate(req: GenerateRequest, request: Request):
    ctx = get_ctx(request)
    engine = ctx.engine
    sub = await ctx.submit_traced(req, request)
    stream = sub.stream
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
        ctx.tracer.end(sub.span, None if gone else last, stream.request_id, sub.params)
    if isinstance(events[-1], ErrorEvent):
        if events[-1].error_type == CLIENT_GONE:
            return Response(status_code=499)
        status = 422 if events[-1].error_type == ERROR_VALIDATION else 500  # the request's fault, or the engine's
        return error_response(status, events[-1].message, events[-1].error_type)
    return JSONResponse(sub.render.response(events, req.parameters.details or req.parameters.decoder_input_details))


@router.post("/generate_stream")
async def generate_stream(req: GenerateRequest, request: Request):
    if req.parameters.scoring_only:
        raise APIError(422, "`max_new_tokens` must be an integer >= 1 on `/generate_stream` "
                            "(0, prompt scoring, is answered by `/generate`)", "validation")
    ctx = get_ctx(request)
    sub = await ctx.submit_traced(req, request)
    stream, engine = sub.stream, ctx.engine

    async def sse():
        finished, e = False, None
        try:
            async for batch in stream.batches():  # the events that are there: one write
                frames = []
                try:
                    for e in batch:
                        if isinstance(e, ErrorEvent):
                            frames.append(_error_frame(e.message, e.error_type))
                        else:
                            frames.append(f"data: {json.dumps(sub.render.event(e))}\n\n")
                except Exception as exc:  # this request only: its last event says so, the worker serves on
                    logger.exception("Rendering a stream event failed on %s (this request only)", request.url.path)
                    frames.append(_error_frame(f"Processing the request failed on the worker ({type(exc).__name__}); "
                                               "see its log", ERROR_REQUEST_FAILED))
                    yield "".join(frames)
                    return  # not finished: the finally aborts the engine's request
                finished = is_last(batch[-1])
                yield "".join(frames)
        finally:
            if not finished:  # cancelled: the client went away mid-stream
                engine.abort(stream.request_id)
            ctx.tracer.end(sub.span, e if finished else None, stream.request_id, sub.params)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
