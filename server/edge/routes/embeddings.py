"""`POST /v1/embeddings`, in OpenAI's shape (the `openai` client's `embeddings.create`).

The route checks the request, reads the pooling the model's checkpoint asks for
(server/protocol/openai/embeddings.py), and has a worker of the model embed the inputs
(workers/serving/routes/embed.py: the model's last hidden states, pooled, cut to `dimensions`,
normalised). `--task generate` refuses it by name.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.dispatch.dispatcher import DispatchError
from server.edge.context import get_ctx
from server.edge.routes._chat import worker_failure
from server.edge.routes._common import constraints, to_worker
from server.edge.routes._params import check_fields, with_headers
from server.protocol.openai.embeddings import EmbeddingsRequest, embeddings_response, pooling_of
from workers.contract import MAX_EMBED_INPUTS, EmbedRequest

router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS = {code: {"description": "OpenAI-shaped error"} for code in (400, 401, 404, 413, 422, 429, 503)}


@router.post("/embeddings", response_model=None, responses=_ERRORS)
async def create_embeddings(req: EmbeddingsRequest, request: Request) -> Response:
    """One vector per input (a text, texts, token ids or lists of them)."""
    router_ctx = get_ctx(request)
    warn = check_fields(router_ctx.settings, req, "/v1/embeddings")
    if router_ctx.settings.protocol.task == "generate":
        raise DispatchError(400, "This server runs `--task generate`: /v1/embeddings is off. Accepted: start it with "
                                 "`--task embed` or `--task auto`", "invalid_request_error")
    ctx = router_ctx.model(req.model)
    items = req.items()
    if not items or len(items) > MAX_EMBED_INPUTS:
        raise DispatchError(422, f"`input` holds {len(items)} inputs. Accepted: 1 to {MAX_EMBED_INPUTS}", "validation")
    try:
        pooling = pooling_of(ctx._dir())
    except ValueError as e:
        raise DispatchError(400, str(e), "invalid_request_error") from e
    if req.dimensions is not None and not pooling.matryoshka:
        raise DispatchError(400, f"`dimensions` = `{req.dimensions}`: model `{ctx.model_id()}` is not "
                                 "matryoshka-trained (its config.json sets no `is_matryoshka`), so a cut vector "
                                 "means nothing. Accepted: no `dimensions`", "invalid_request_error")
    body = to_worker(lambda: EmbedRequest(inputs=items, pooling=pooling.mode, normalize=pooling.normalize,
                                          dimensions=req.dimensions))
    reply = await ctx.dispatcher.generate("/embed", body, constraints(request, req.user, ctx.name))
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    answer = json.loads(reply.content)
    return with_headers(JSONResponse(embeddings_response(ctx.model_id(), answer["embeddings"], answer["tokens"],
                                                         req.encoding_format), headers=reply.headers), warn)
