"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

So the `openai` client works unchanged (`base_url="http://127.0.0.1:8000/v1"`). Each
choice is one worker `/generate` call (choices of one request may run on different
workers, concurrently); streams relay one worker's token events as OpenAI chunks and end
with `data: [DONE]`. Chat prompts are rendered with the model's chat template. `n` > 1
with a `seed` gives choice k the seed `seed + k`, so choices differ yet stay reproducible.
Streaming serves one choice (`n` = 1, one prompt). Any model name is accepted: this
server serves one model, named in `/v1/models` and in every response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server import openai_format as fmt
from server.balancer import Constraints
from server.context import RouterContext, get_ctx
from server.dispatch import DispatchError, WorkerReply, WorkerStream
from server.http_errors import error_response
from server.routes._common import RelayResponse, check_new_tokens, close_shielded, constraints, parse_event
from server.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
from server.worker_client import WorkerGone

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS = {code: {"description": "OpenAI-shaped error"} for code in (401, 413, 422, 429, 503)}


def _merged_headers(replies: list[WorkerReply]) -> dict[str, str]:
    """Worker headers of several choices: distinct values, comma-separated, in order."""
    merged: dict[str, list[str]] = {}
    for r in replies:
        for name, value in r.headers.items():
            if value not in merged.setdefault(name, []):
                merged[name].append(value)
    return {name: ",".join(values) for name, values in merged.items()}


def _choice_params(params: dict, k: int) -> dict:
    return {**params, "seed": params["seed"] + k} if k and "seed" in params else params


async def _generate_all(ctx: RouterContext, c: Constraints, bodies: list[dict]) -> list[WorkerReply]:
    results = await asyncio.gather(*(ctx.dispatcher.generate("/generate", b, c) for b in bodies),
                                   return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def _failed(path: str, replies: list[WorkerReply]) -> Response | None:
    """The first worker error as an OpenAI error response, if any choice failed."""
    for r in replies:
        if r.status != 200:
            message, kind = fmt.worker_error(r.content)
            headers = dict(r.headers)
            if r.status == 429:
                headers["retry-after"] = "1"
            return error_response(path, r.status, message, kind, headers)
    return None


@router.get("/models")
async def models(request: Request) -> dict:
    """The served model (one per server)."""
    ctx = get_ctx(request)
    return {"object": "list", "data": [{"id": ctx.model_id(), "object": "model", "created": int(ctx.started_at),
                                        "owned_by": "hetserve"}]}


@router.post("/completions", response_model=None, responses=_ERRORS)
async def completions(req: CompletionRequest, request: Request) -> Response:
    """Text completion (`prompt`: a string or a list of strings)."""
    ctx, c = get_ctx(request), constraints(request)
    check_new_tokens(ctx, req.max_tokens, "max_tokens")
    params = req.sampling(req.max_tokens, ctx.sampling_defaults())
    prompts = req.prompts
    if req.stream:
        if len(prompts) * req.n != 1:
            raise DispatchError(422, "Streaming serves one choice: send one `prompt` and `n` = 1", "validation")
        return await _stream(ctx, c, request, {"inputs": prompts[0], "parameters": params}, chat=False,
                             options=req.stream_options, prefix=prompts[0] if req.echo else "")
    jobs = [(i, k) for i in range(len(prompts)) for k in range(req.n)]
    replies = await _generate_all(ctx, c, [{"inputs": prompts[i], "parameters": _choice_params(params, k)}
                                           for i, k in jobs])
    if (failed := _failed(request.url.path, replies)) is not None:
        return failed
    choices, prompt_tokens, completion_tokens = [], {}, 0
    for index, ((i, _k), reply) in enumerate(zip(jobs, replies, strict=True)):
        body = json.loads(reply.content)
        details = body.get("details") or {}
        text = body.get("generated_text", "")
        choices.append(fmt.completion_choice(index, prompts[i] + text if req.echo else text, details))
        prompt_tokens[i] = details.get("input_length") or 0
        completion_tokens += details.get("generated_tokens") or 0
    use = fmt.usage(sum(prompt_tokens.values()), completion_tokens)
    return JSONResponse(fmt.completion(fmt.new_id("cmpl"), ctx.model_id(), choices, use),
                        headers=_merged_headers(replies))


@router.post("/chat/completions", response_model=None, responses=_ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    """Chat completion; the prompt is the messages rendered with the model's chat template."""
    ctx, c = get_ctx(request), constraints(request)
    check_new_tokens(ctx, req.max_new_tokens, "max_tokens")
    prompt = ctx.chat_template().render(req.template_messages(), add_generation_prompt=True)
    params = req.sampling(req.max_new_tokens, ctx.sampling_defaults())
    if req.stream:
        if req.n != 1:
            raise DispatchError(422, "Streaming serves one choice: `n` must be 1", "validation")
        return await _stream(ctx, c, request, {"inputs": prompt, "parameters": params}, chat=True,
                             options=req.stream_options)
    replies = await _generate_all(ctx, c, [{"inputs": prompt, "parameters": _choice_params(params, k)}
                                           for k in range(req.n)])
    if (failed := _failed(request.url.path, replies)) is not None:
        return failed
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for k, reply in enumerate(replies):
        body = json.loads(reply.content)
        details = body.get("details") or {}
        choices.append(fmt.chat_choice(k, body.get("generated_text", ""), details))
        prompt_tokens = details.get("input_length") or prompt_tokens
        completion_tokens += details.get("generated_tokens") or 0
    return JSONResponse(fmt.chat_completion(fmt.new_id("chatcmpl"), ctx.model_id(), choices,
                                            fmt.usage(prompt_tokens, completion_tokens)),
                        headers=_merged_headers(replies))


async def _stream(ctx: RouterContext, c: Constraints, request: Request, body: dict, chat: bool,
                  options: StreamOptions | None, prefix: str = "") -> Response:
    opened = await ctx.dispatcher.open_stream("/generate_stream", body, c)
    if isinstance(opened, WorkerReply):
        return _failed(request.url.path, [opened]) or Response(opened.content, opened.status, headers=opened.headers)
    include_usage = bool(options and options.include_usage)
    return RelayResponse(_relay(opened, ctx, chat, include_usage, prefix), opened)


async def _relay(stream: WorkerStream, ctx: RouterContext, chat: bool, include_usage: bool, prefix: str):
    """Worker token events -> OpenAI chunks, `[DONE]` at the end, an error event if the worker is lost."""
    cid, created, model = fmt.new_id("chatcmpl" if chat else "cmpl"), int(time.time()), ctx.model_id()

    def chunk(text: str | None, finish: str | None) -> str:
        if chat:
            return fmt.sse(fmt.chat_chunk(cid, created, model, {} if text is None else {"content": text}, finish))
        return fmt.sse(fmt.completion_chunk(cid, created, model, text or "", finish))

    sent = 0
    try:
        if chat:
            yield fmt.sse(fmt.chat_chunk(cid, created, model, {"role": "assistant", "content": ""}, None))
        if prefix:
            yield chunk(prefix, None)
        async for data in stream.events():
            event = parse_event(data) or {}
            if event.get("error") is not None:
                yield fmt.sse({"error": {"message": str(event["error"]), "type": event.get("error_type", "internal"),
                                         "param": None, "code": None}})
                return
            token = event.get("token") or {}
            if token.get("text") and not token.get("special"):
                yield chunk(token["text"], None)
            sent += 1
            details = event.get("details")
            if details is not None or event.get("generated_text") is not None:
                yield chunk(None, fmt.finish_reason(details) or "stop")
                if include_usage:
                    use = fmt.usage((details or {}).get("input_length") or 0, (details or {}).get("generated_tokens") or sent)
                    yield fmt.sse(fmt.usage_chunk(cid, created, model, "chat.completion.chunk" if chat else "text_completion", use))
                yield "data: [DONE]\n\n"
                return
        error = stream.lost_message(sent)
    except WorkerGone as e:
        logger.warning("stream on worker %s lost after %d events: %r", stream.worker.id, sent, e)
        error = stream.lost_message(sent)
    finally:
        await close_shielded(stream)
    ctx.metrics.stream_error(stream.worker)
    yield fmt.sse({"error": {"message": error, "type": "incomplete_generation", "param": None, "code": None}})
