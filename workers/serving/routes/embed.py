"""`POST /embed`: vectors of whole texts, pooled from the model's last hidden states.

The router's `/v1/embeddings` (server/edge/routes/embeddings.py) sends texts or token ids with
the pooling its checkpoint's sentence-transformers config names; this route encodes the texts
as generation would (`add_special_tokens` true), checks the lengths against the context and
the ids against the vocabulary (422 naming the first bad one), all on a thread, and runs
`workers/engine/pooling.py` `embed` on a thread, between engine steps. The request counts as one
of the engine's in flight while it runs (refused 429 when the worker is full), and a client that
goes away stops it after the text being embedded.
"""

from __future__ import annotations

import asyncio
import threading

from fastapi import APIRouter, Request

from workers.contract import EmbedRequest
from workers.engine.core import EngineOverloaded, EngineUnavailable
from workers.engine.pooling import embed
from workers.serving.context import CLIENT_GONE, client_gone, get_ctx
from workers.serving.errors import APIError

router = APIRouter()


@router.post("/embed")
async def embed_texts(req: EmbedRequest, request: Request) -> dict:
    ctx = get_ctx(request)
    vocab, limit = ctx.grammars.vocab_size, ctx.engine.scheduler.config.max_seq_len
    hidden = ctx.engine.runner.model.config.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise APIError(422, f"`dimensions` = `{req.dimensions}` exceeds the model's {hidden}", "validation")

    def encode() -> list[list[int]]:
        texts = []
        for k, item in enumerate(req.inputs):
            ids = ctx.tokenizer.encode(item, add_special_tokens=True).ids if isinstance(item, str) else item
            if not ids:
                raise APIError(422, f"`input[{k}]` is empty. Accepted: a text or token ids, at least one token",
                               "validation")
            if len(ids) > limit:
                raise APIError(422, f"`input[{k}]` has {len(ids)} tokens, over the model's context of {limit}",
                               "validation")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(422, f"`input[{k}]` holds `{bad}`, outside the vocabulary (0 to {vocab - 1})",
                               "validation")
            texts.append(list(ids))
        return texts

    texts = await asyncio.to_thread(encode)  # long texts are encoded off the event loop
    try:
        with ctx.engine.side_work():
            vectors = await _until_gone(request, lambda stop: embed(ctx.engine, texts, req.pooling, req.dimensions,
                                                                    req.normalize, stop))
    except EngineOverloaded as e:
        raise APIError(429, str(e), "overloaded", {"Retry-After": "1"}) from e
    except EngineUnavailable as e:
        raise APIError(503, str(e), "unavailable") from e
    if vectors is None:
        raise APIError(499, "The client disconnected while its embeddings ran", CLIENT_GONE)
    return {"embeddings": vectors, "tokens": [len(t) for t in texts]}


async def _until_gone(request: Request, work):
    """`work(stop)` on a thread; when the client goes away first, `stop` is set and the work's own
    None answer (it stops between two forwards) is awaited, so nothing outlives the request."""
    stop = threading.Event()
    running = asyncio.ensure_future(asyncio.to_thread(work, stop))
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait((running, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not running.done():
            stop.set()
    return await asyncio.shield(running)
