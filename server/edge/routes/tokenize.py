"""`POST /tokenize` and `POST /detokenize`, in vLLM's shapes.

`/tokenize` takes a `prompt` (text) or chat `messages` (rendered with the model's chat template,
`tools` and `chat_template_kwargs`, with the generation prompt unless `add_generation_prompt`
is false) and answers `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize`
takes `tokens` and answers `{"prompt"}`. Both are answered by a worker of the model
(workers/serving/routes/tokens.py), so a count is what generation would see. One difference
from vLLM, on purpose: for `messages`, `add_special_tokens` defaults to true, because that is
how this server's workers encode a chat prompt to generate from it (vLLM encodes chat prompts
without them and defaults to false). `continue_final_message` is refused (not implemented).
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError, model_validator

from server.edge.context import get_ctx
from server.edge.routes._chat import render_prompt, worker_failure
from server.edge.routes._common import constraints, to_worker
from server.edge.routes._params import check_fields, with_headers
from server.protocol.base import EdgeRequest, refuse
from server.protocol.openai.requests import ChatCompletionRequest, ChatMessage, Tool
from workers.contract import wire

router = APIRouter(tags=["tokenizer"])

_ERRORS = {code: {"description": "error"} for code in (400, 401, 404, 413, 422, 429, 503)}
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class TokenizeRequest(EdgeRequest):
    model: str | None = Field(None, max_length=1000)
    prompt: str | None = Field(None, max_length=1_000_000)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Give `prompt` (text) or `messages` (a chat), exactly one of them")
        refuse(self, {"continue_final_message": (False,)})
        return self


class DetokenizeRequest(EdgeRequest):
    model: str | None = Field(None, max_length=1000)
    tokens: list[TokenId] = Field(max_length=1_000_000)


@router.post("/tokenize", response_model=None, responses=_ERRORS)
async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    """The token ids of a prompt, or of chat messages rendered with the model's template."""
    warn = check_fields(get_ctx(request).settings, req, "/tokenize")
    ctx = get_ctx(request).model(req.model)
    text = req.prompt
    if req.messages is not None:
        try:
            chat = ChatCompletionRequest.model_validate(
                {"messages": [m.model_dump(exclude_none=True) for m in req.messages],
                 "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                 "chat_template_kwargs": req.chat_template_kwargs})
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        text = render_prompt(ctx, chat, req.add_generation_prompt)
    body = to_worker(lambda: wire.TokenizeRequest(prompt=text, add_special_tokens=req.add_special_tokens,
                                                  return_token_strs=req.return_token_strs))
    reply = await ctx.dispatcher.generate("/tokenize", body, constraints(request, None, ctx.name))
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    return with_headers(JSONResponse(json.loads(reply.content), headers=reply.headers), warn)


@router.post("/detokenize", response_model=None, responses=_ERRORS)
async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
    """The text of token ids."""
    warn = check_fields(get_ctx(request).settings, req, "/detokenize")
    ctx = get_ctx(request).model(req.model)
    reply = await ctx.dispatcher.generate("/detokenize", to_worker(lambda: wire.DetokenizeRequest(tokens=req.tokens)),
                                         constraints(request, None, ctx.name))
    if reply.status != 200:
        return worker_failure(request.url.path, reply)
    return with_headers(JSONResponse(json.loads(reply.content), headers=reply.headers), warn)
