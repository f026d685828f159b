"""Anthropic's Messages API: `POST /v1/messages`, `POST /v1/messages/count_tokens`.

So the `anthropic` client (and Claude Code, pointed here with `ANTHROPIC_BASE_URL`) works
unchanged; its key may come as `x-api-key` (server/edge/middleware.py) and its errors come in
Anthropic's shape (server/edge/errors.py). A request is translated into a chat request
(server/protocol/anthropic/requests.py) and served by the chat pipeline
(server/edge/routes/_chat.py: the same template, tools in the model's own format, grammar,
reasoning), then shaped as a message with content blocks, whole or as Anthropic's stream
events (server/protocol/anthropic/messages.py); a stream's prompt is counted by the worker that
took it, once it has, so `message_start` carries `input_tokens` as Anthropic's does.
`count_tokens` renders the same prompt and asks a worker to count its tokens, as the worker
would encode it to generate.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from server.dispatch.dispatcher import WorkerReply
from server.dispatch.migration import open_client_stream
from server.edge.context import ModelContext, get_ctx
from server.edge.routes._chat import ChatJob, prepare_chat, relay_choice, worker_failure
from server.edge.routes._common import RelayResponse, check_new_tokens, constraints
from server.edge.routes._params import check_fields, with_headers
from server.fleet.client import WorkerGone
from server.protocol.anthropic.messages import MessageEvents, message_id, message_object, usage
from server.protocol.anthropic.requests import MessagesBase, MessagesRequest, chat_request
from server.protocol.openai.choices import ChoiceStream, chat_choice
from server.protocol.openai.requests import ChatCompletionRequest
from workers.contract import TokenizeRequest

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["anthropic"])

_ERRORS = {code: {"description": "Anthropic-shaped error"} for code in (400, 401, 404, 413, 422, 429, 503)}
_STREAM = {200: {"content": {"text/event-stream": {}}, "description": "the message, or its stream events"}}


def _job(ctx: ModelContext, req: MessagesBase) -> ChatJob:
    try:
        chat = ChatCompletionRequest.model_validate(chat_request(req))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    check_new_tokens(ctx, chat.max_new_tokens, "max_tokens")
    return prepare_chat(ctx, chat)


@router.post("/messages", response_model=None, responses={**_STREAM, **_ERRORS})
async def create_message(req: MessagesRequest, request: Request) -> Response:
    """A message answering `messages`; Anthropic's stream events with `stream`."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/messages")  # unknown fields: 400 or a warning
    return with_headers(await _message(req, request), warn)


async def _message(req: MessagesRequest, request: Request) -> Response:
    ctx = get_ctx(request).model(req.model)
    job = _job(ctx, req)
    c = constraints(request, req.metadata.user_id if req.metadata else None, ctx)
    spec, body, mid = job.specs[0], job.bodies[0], message_id()
    if req.stream:
        opened = await open_client_stream(ctx.dispatcher, "/generate_stream", body, c)
        if isinstance(opened, WorkerReply):
            return worker_failure(request.url.path, opened)
        writer, choice = MessageEvents(mid, ctx.model_id(), req.stop_sequences), ChoiceStream(spec, chat=True)

        async def events():
            yield writer.start(await _count(opened.worker, job.prompt))
            async for frames in relay_choice(opened, choice, writer, ctx):
                yield frames

        return RelayResponse(events(), opened)
    reply = await ctx.dispatcher.generate("/generate", body, c)
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    answer = json.loads(reply.content)
    details = answer.get("details") or {}
    use = usage(details.get("input_length") or 0, details.get("generated_tokens") or 0)
    return JSONResponse(message_object(mid, ctx.model_id(), chat_choice(spec, answer), use, req.stop_sequences),
                        headers=reply.headers)


async def _count(worker, prompt: str) -> int:
    """The prompt's tokens, counted by the worker generating from it (asked directly: no routing,
    no admission slot); 0 when it cannot say (the count is a hint: `message_delta` carries the
    worker's own at the end)."""
    try:
        status, _, content = await worker.client.post("/tokenize", TokenizeRequest(prompt=prompt))
        return int(json.loads(content)["count"]) if status == 200 else 0
    except (*WorkerGone, ValueError, KeyError) as e:  # gone meanwhile (the stream says so), or no count
        logger.info("no prompt count from %s: %r", worker.id, e)
        return 0


@router.post("/messages/count_tokens", response_model=None, responses=_ERRORS)
async def count_tokens(req: MessagesBase, request: Request) -> Response:
    """The tokens of the prompt these messages (system, tools) render to."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/messages/count_tokens")
    ctx = get_ctx(request).model(req.model)
    job = _job(ctx, req)
    reply = await ctx.dispatcher.generate("/tokenize", TokenizeRequest(prompt=job.prompt),
                                         constraints(request, None, ctx.name))
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    return with_headers(JSONResponse({"input_tokens": json.loads(reply.content)["count"]}, headers=reply.headers),
                        warn)
