"""OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}`.

So the `openai` client's `client.responses.create` / `client.responses.stream` (the Agents SDK,
Codex) work unchanged. A request is translated into a chat request
(server/protocol/responses/requests.py) and served by the chat pipeline
(server/edge/routes/_chat.py: the same template, tools in the model's own format, grammar,
reasoning parser), then shaped back: whole, as a `response` object with its output items
(server/protocol/responses/output.py), or streamed as typed `response.*` events
(server/protocol/responses/events.py). A stored response (`store`, default true) is kept in a
bounded in-memory store (server/protocol/responses/store.py) that `previous_response_id`
continues from; `store: false` keeps nothing. A stream that no worker can finish ends with an
`error` event, and is not stored.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from server.dispatch.dispatcher import DispatchError, WorkerReply
from server.dispatch.migration import open_client_stream
from server.edge.context import get_ctx
from server.edge.routes._chat import prepare_chat, relay_choice, worker_failure
from server.edge.routes._common import RelayResponse, check_new_tokens, constraints
from server.edge.routes._params import check_fields, with_headers
from server.protocol.openai.choices import ChoiceStream, chat_choice
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.responses.events import ResponseEvents
from server.protocol.responses.output import item_id, output_items, response_object, usage
from server.protocol.responses.requests import InputItem, ResponsesRequest, chat_request
from server.protocol.responses.store import MAX_RESPONSES, ResponseStore

router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS = {code: {"description": "OpenAI-shaped error"} for code in (400, 401, 404, 413, 422, 429, 503)}
_STREAM = {200: {"content": {"text/event-stream": {}}, "description": "the response, or its `response.*` events"}}
_ITEMS = TypeAdapter(list[InputItem])


def response_store(request: Request) -> ResponseStore:
    """This app's store of responses (made on first use)."""
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def _history(store: ResponseStore, previous: str | None) -> list:
    """The items `previous_response_id` continues from (404 when it is not stored)."""
    if previous is None:
        return []
    stored = store.get(previous)
    if stored is None:
        raise DispatchError(404, f"No stored response `{previous[:80]}`: it was made with `store` false, or is older "
                                 f"than the {MAX_RESPONSES} responses kept. Accepted: the id of a stored response, or "
                                 "the whole conversation as `input`", "not_found")
    return _ITEMS.validate_python(list(stored.items))


@router.post("/responses", response_model=None, responses={**_STREAM, **_ERRORS})
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    """A model response to `input` (text or items), streamed as `response.*` events with `stream`."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/responses")  # unknown fields: 400 or a warning
    return with_headers(await _respond(req, request), warn)


async def _respond(req: ResponsesRequest, request: Request) -> Response:
    ctx = get_ctx(request).model(req.model)
    store = response_store(request)
    history = _history(store, req.previous_response_id)
    try:
        chat = ChatCompletionRequest.model_validate(chat_request(req, history))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    check_new_tokens(ctx, chat.max_new_tokens, "max_output_tokens")
    c = constraints(request, req.prompt_cache_key or req.user, ctx.name)  # X-Session-Id first
    job = prepare_chat(ctx, chat)
    spec, body = job.specs[0], job.bodies[0]
    rid = item_id("resp")
    given = [item.model_dump(by_alias=True, exclude_none=True) for item in [*history, *req.items()]]
    if req.stream:
        opened = await open_client_stream(ctx.dispatcher, "/generate_stream", body, c)
        if isinstance(opened, WorkerReply):
            return worker_failure(request.url.path, opened)
        writer, choice = ResponseEvents(rid, ctx.model_id(), req), ChoiceStream(spec, chat=True)

        async def events():
            yield writer.start()
            async for frames in relay_choice(opened, choice, writer, ctx):
                yield frames
            if writer.response is not None and req.store:
                store.put(rid, given + writer.items, writer.response)

        return RelayResponse(events(), opened)
    reply = await ctx.dispatcher.generate("/generate", body, c)
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    answer = json.loads(reply.content)
    details = answer.get("details") or {}
    choice = chat_choice(spec, answer)
    items = output_items(choice)
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    response = response_object(rid, ctx.model_id(), req, items, status,
                               usage(details.get("input_length") or 0, details.get("generated_tokens") or 0))
    if req.store:
        store.put(rid, given + items, response)
    return JSONResponse(response, headers=reply.headers)


@router.get("/responses/{response_id}", response_model=None, responses=_ERRORS)
async def get_response(response_id: str, request: Request) -> Response:
    """A stored response, as it was answered."""
    stored = response_store(request).get(response_id)
    if stored is None:
        raise DispatchError(404, f"No stored response `{response_id[:80]}`. Accepted: the id of a response made "
                                 "with `store` true (the latest ones are kept)", "not_found")
    return JSONResponse(stored.response)
