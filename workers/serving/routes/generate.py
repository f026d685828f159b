"""`POST /generate` and `POST /generate_stream` (SSE), in TGI's shapes.

Design: the context admits a request (tokenized, validated, queued) and the route only awaits its
`RequestStream`. A client that goes away is noticed by a task waiting for `http.disconnect`
(non-streamed) or by Starlette cancelling the stream; both abort the request, freeing its KV
blocks before the next step. Each request has one span, ended with what happened to it. A raise
while rendering a stream's events ends that stream with a `request_failed` error event, never a
broken connection, which the router would read as the worker's death. A `/generate_stream` that
names the router's channel is answered at once, its events on the channel
(workers/serving/channel.py); so is a `/generate` naming it, whose answer the router builds from
the events (a channel of token ids). Trade-off: a disconnect watcher task per non-streamed request."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from workers.contract import (
    HEADER_CHANNEL,
    HEADER_STREAM_KEY,
    HEADER_TEXT,
    HEADER_VOCAB,
    TEXT_IDS,
    AbortStreams,
    WorkerRequest,
)
from workers.contract.errors import ERROR_VALIDATION
from workers.engine.core import Engine
from workers.engine.events import ErrorEvent, RequestStream
from workers.serving.channel import LAST, ChannelResponse, StreamChannel, render_batch
from workers.serving.context import CLIENT_GONE, get_ctx
from workers.serving.errors import APIError, error_response

router = APIRouter()
logger = logging.getLogger(__name__)


async def _abort_on_disconnect(request: Request, engine: Engine, stream: RequestStream) -> None:
    """Waits until the client goes away (the body has already been read), then aborts its
    request and ends its stream."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(stream.request_id)
    stream.push(ErrorEvent("The client disconnected", CLIENT_GONE))


@router.post("/generate")
async def generate(req: WorkerRequest, request: Request):
    ctx = get_ctx(request)
    on_channel = _channel_stream(ctx, request)
    if on_channel is not None:  # the router builds the answer from the stream's token ids
        return await _on_channel(ctx, req, request, *on_channel)
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
async def generate_stream(req: WorkerRequest, request: Request):
    if req.parameters.scoring_only:
        raise APIError(422, "`max_new_tokens` must be an integer >= 1 on `/generate_stream` "
                            "(0, prompt scoring, is answered by `/generate`)", "validation")
    ctx = get_ctx(request)
    on_channel = _channel_stream(ctx, request)
    if on_channel is not None:
        return await _on_channel(ctx, req, request, *on_channel)
    sub = await ctx.submit_traced(req, request)
    stream, engine = sub.stream, ctx.engine

    async def sse():
        finished, e = False, None
        try:
            async for batch in stream.batches():  # the events that are there: one write
                text, ended = render_batch(sub, batch, request.url.path)
                yield text
                if ended is not None:  # FAILED: not finished, the finally aborts the engine's request
                    finished, e = ended == LAST, batch[-1]
                    return
        finally:
            if not finished:  # cancelled (the client went away mid-stream), or rendering failed
                engine.abort(stream.request_id)
            ctx.tracer.end(sub.span, e if finished else None, stream.request_id, sub.params)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _on_channel(ctx, req: WorkerRequest, request: Request, channel: StreamChannel, key: int) -> Response:
    """Admit `req` and carry its events on `channel` under `key`: an empty 200 at once (or the
    refusal). On a channel of token ids the engine builds no text for it."""
    sub = await ctx.submit_traced(req, request, text=not channel.ids)
    if channel.closed:  # the router's channel went away while this request was admitted
        ctx.engine.abort(sub.stream.request_id)
        ctx.tracer.end(sub.span, None, sub.stream.request_id, sub.params)
        raise APIError(503, f"The stream channel `{channel.id}` closed; open another with GET /streams",
                       "unavailable")
    channel.add(key, sub)
    return Response(status_code=200)


def _channel_stream(ctx, request: Request) -> tuple[StreamChannel, int] | None:
    """The channel and key a streamed request names (workers/serving/channel.py), None when it
    names none; an `APIError` when they are not usable."""
    channel_id = request.headers.get(HEADER_CHANNEL)
    if channel_id is None:
        return None
    channel = ctx.channels.get(channel_id)
    if channel is None:
        raise APIError(503, f"No stream channel `{channel_id}` is open on this worker; open one with GET /streams",
                       "unavailable")
    key = request.headers.get(HEADER_STREAM_KEY, "")
    if not (key.isascii() and key.isdigit()) or int(key) in channel.streams:
        raise APIError(422, f"`{HEADER_STREAM_KEY}` must be a decimal stream key not in use on the channel, "
                            f"got `{key}`", "validation")
    return channel, int(key)


@router.get("/streams")
async def open_channel(request: Request):
    """The router's stream channel (workers/serving/channel.py)."""
    ctx = get_ctx(request)
    if not ctx.ready:
        raise APIError(503, f"Worker `{ctx.info.worker_id}` is {ctx.status}: not accepting streams", "unavailable")
    channel = StreamChannel(ctx, ids=request.headers.get(HEADER_TEXT) == TEXT_IDS)
    ctx.channels[channel.id] = channel
    return ChannelResponse(channel)


@router.get("/tokenizer")
async def tokenizer_json(request: Request):
    """The tokenizer's JSON, for a router that builds the text of an `ids` channel's streams."""
    ctx = get_ctx(request)
    if ctx.tokenizer_json is None:
        ctx.tokenizer_json = (await asyncio.to_thread(ctx.tokenizer.to_str)).encode()
    return Response(ctx.tokenizer_json, media_type="application/json",
                    headers={HEADER_VOCAB: str(ctx.grammars.vocab_size)})


@router.post("/streams/abort")
async def abort_streams(body: AbortStreams, request: Request):
    """End the named streams of a channel (their clients left); a channel already gone aborted
    them all when it closed."""
    channel = get_ctx(request).channels.get(body.channel)
    return {"aborted": 0 if channel is None else channel.abort(body.streams)}
