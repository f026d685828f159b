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
`error` event, and is not stored. Work that grows with a continued conversation (parsing the
stored history, checking and rendering its messages, serializing what is stored) runs in a
worker thread, so the event loop that serves every other request never waits on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import anyio
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from server.dispatch.dispatcher import DispatchError, WorkerReply
from server.dispatch.migration import open_client_stream
from server.edge.context import ModelContext, get_ctx
from server.edge.routes._chat import ChatJob, prepare_chat, relay_choice, worker_failure
from server.edge.routes._common import RelayResponse, check_new_tokens, constraints
from server.edge.routes._params import check_fields, with_headers
from server.protocol.openai.choices import ChoiceStream, chat_choice
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.responses.events import ResponseEvents
from server.protocol.responses.output import item_id, output_items, response_object, usage
from server.protocol.responses.requests import InputItem, ResponsesRequest, chat_request
from server.protocol.responses.store import (
    MAX_RESPONSES,
    ResponseStore,
    Stored,
    check_conversation,
    items_json,
    join_items,
)

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


def _stored(store: ResponseStore, previous: str | None) -> Stored | None:
    """The stored response `previous_response_id` continues (404 when it is not stored)."""
    if previous is None:
        return None
    stored = store.get(previous)
    if stored is None:
        raise DispatchError(404, f"No stored response `{previous[:80]}`: it was made with `store` false, or is older "
                                 f"than the {MAX_RESPONSES} responses kept. Accepted: the id of a stored response, or "
                                 "the whole conversation as `input`", "not_found")
    return stored


@dataclass(frozen=True)
class _Prepared:
    """A request ready to send, and the conversation it continues as it will be stored."""

    chat: ChatCompletionRequest
    job: ChatJob
    given: bytes  # the history's items and the request's, as one JSON array
    count: int


def _prepare(ctx: ModelContext, req: ResponsesRequest, stored: Stored | None) -> _Prepared:
    """Bounds, the history parsed once, the chat request and its prompt (in a worker thread:
    all of it grows with the history)."""
    mine = req.items()
    added = items_json([item.model_dump(by_alias=True, exclude_none=True) for item in mine])
    if req.previous_response_id is not None:
        try:
            check_conversation(stored, req.previous_response_id, len(mine), len(added))
        except ValueError as e:
            raise DispatchError(400, str(e), "invalid_request_error") from e
    history = _ITEMS.validate_json(stored.items) if stored is not None else []
    try:
        chat = ChatCompletionRequest.model_validate(chat_request(req, history))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    job = prepare_chat(ctx, chat)
    held = stored.items if stored is not None else b"[]"
    return _Prepared(chat, job, join_items(held, added), len(history) + len(mine))


def _keep(store: ResponseStore, rid: str, prepared: _Prepared, output: list[dict], response: dict) -> None:
    """Store the conversation with its output, serialized once (in a worker thread)."""
    items = join_items(prepared.given, items_json(output))
    store.put(rid, Stored(items, prepared.count + len(output), json.dumps(response, ensure_ascii=False).encode()))


@router.post("/responses", response_model=None, responses={**_STREAM, **_ERRORS})
async def create_response(req: ResponsesRequest, request: Request) -> Response:
    """A model response to `input` (text or items), streamed as `response.*` events with `stream`."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/responses")  # unknown fields: 400 or a warning
    return with_headers(await _respond(req, request), warn)


async def _respond(req: ResponsesRequest, request: Request) -> Response:
    ctx = get_ctx(request).model(req.model)
    store = response_store(request)
    stored = _stored(store, req.previous_response_id)
    ctx.chat_template()  # loaded here (once per model), not raced for by threads
    prepared = await anyio.to_thread.run_sync(_prepare, ctx, req, stored)
    check_new_tokens(ctx, prepared.chat.max_new_tokens, "max_output_tokens")
    c = constraints(request, req.prompt_cache_key or req.user, ctx)  # X-Session-Id first
    spec, body = prepared.job.specs[0], prepared.job.bodies[0]
    rid = item_id("resp")
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
                await anyio.to_thread.run_sync(_keep, store, rid, prepared, writer.items, writer.response)

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
        await anyio.to_thread.run_sync(_keep, store, rid, prepared, items, response)
    return JSONResponse(response, headers=reply.headers)


@router.get("/responses/{response_id}", response_model=None, responses=_ERRORS)
async def get_response(response_id: str, request: Request) -> Response:
    """A stored response, as it was answered."""
    stored = response_store(request).get(response_id)
    if stored is None:
        raise DispatchError(404, f"No stored response `{response_id[:80]}`. Accepted: the id of a response made "
                                 "with `store` true (the latest ones are kept)", "not_found")
    return Response(stored.response, media_type="application/json")
