"""OpenAI-compatible routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`.

So the `openai` client works unchanged (`base_url="http://127.0.0.1:8000/v1"`). Design: each
choice is one worker `/generate` call, so choices of one request may run on different workers
concurrently (`n` > 1 with a `seed` gives choice k the seed `seed + k`: they differ yet stay
reproducible), and a stream opens one worker stream per choice and interleaves their deltas,
each chunk carrying its choice's `index`, then `data: [DONE]`; a choice whose worker is lost
mid-way moves (server/dispatch/migration.py). Chat prompts go through the shared chat pipeline
(server/edge/routes/_chat.py: template, tools, grammar, reasoning); `max_tokens` = 0 with `echo`
scores the prompt without generating (answered whole, also when streamed). The `model` field
picks the model (server/fleet/models.py). Trade-off: `n` choices are `n` worker requests, each
prefilling the prompt unless its worker's prefix cache holds it, in exchange for choices that
spread over the workers and fail or move one by one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.dispatch.buffers import STREAM_BUFFER_BYTES, ByteQueue
from server.dispatch.dispatcher import WorkerReply
from server.dispatch.migration import (
    ClientStream,
    StreamIncomplete,
    StreamRefused,
    open_client_stream,
    parse_event,
)
from server.edge.context import RouterContext, get_ctx
from server.edge.errors import error_response
from server.edge.routes._chat import UNREADABLE, choice_request, prepare_chat
from server.edge.routes._common import (
    RelayResponse,
    check_new_tokens,
    close_shielded,
    constraints,
    merged_headers,
    to_worker,
)
from server.edge.routes._params import check_fields, with_headers
from server.edge.routes.models import model_list
from server.fleet.client import split_events
from server.protocol.openai import responses as fmt
from server.protocol.openai.choices import ChoiceSpec, ChoiceStream, chat_choice, completion_choice
from server.protocol.openai.extras import prompt_logprobs
from server.protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from server.routing.filter import Constraints
from workers.contract import WorkerRequest

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS = {code: {"description": "OpenAI-shaped error"} for code in (401, 413, 422, 429, 503)}


async def _generate_all(ctx: RouterContext, c: Constraints, bodies: list[WorkerRequest]) -> list[WorkerReply]:
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


def _usage(bodies: list[dict], prompt_of: list[int]) -> dict:
    """Prompt tokens once per prompt, completion tokens of every choice."""
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    for body, p in zip(bodies, prompt_of, strict=True):
        details = body.get("details") or {}
        prompt_tokens[p] = details.get("input_length") or 0
        completion_tokens += details.get("generated_tokens") or 0
    return fmt.usage(sum(prompt_tokens.values()), completion_tokens)


@router.get("/models")
async def models(request: Request) -> dict:
    """Every model this router offers, loaded or not, with where it is placed."""
    return model_list(get_ctx(request))


@router.post("/completions", response_model=None, responses=_ERRORS)
async def completions(req: CompletionRequest, request: Request) -> Response:
    """Text completion (`prompt`: text, token ids, or a list of either)."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/completions")  # unknown fields: 400 or a warning
    return with_headers(await _completions(req, request), warn)


async def _completions(req: CompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request).model(req.model)
    c = constraints(request, req.session_key(), ctx)
    check_new_tokens(ctx, req.max_tokens, "max_tokens")
    scored = req.scoring_only or (req.echo and req.logprobs is not None)  # the prompt's own logprobs
    params = to_worker(lambda: req.sampling(req.max_tokens, ctx.sampling_defaults(), top_n_tokens=req.logprobs,
                                            decoder_input_details=scored))
    prompts = req.prompts
    jobs = [(i, k) for i in range(len(prompts)) for k in range(req.n)]
    specs = [ChoiceSpec(index, req.logprobs, req.echo, prompts[i] if isinstance(prompts[i], str) else None)
             for index, (i, _k) in enumerate(jobs)]
    bodies = [choice_request(prompts[i], params, k) for i, k in jobs]
    prompt_of = [i for i, _k in jobs]
    if req.stream and not req.scoring_only:
        return await _stream(ctx, c, request, bodies, specs, prompt_of, chat=False, usage=_include_usage(req))
    replies = await _generate_all(ctx, c, bodies)
    if (failed := _failed(request.url.path, replies)) is not None:
        return failed
    answers = [json.loads(r.content) for r in replies]
    use = _usage(answers, prompt_of)
    if req.stream:  # prompt scoring: nothing to wait for, so the whole answer as one stream
        return _whole_stream(ctx, specs, answers, use if _include_usage(req) else None, merged_headers(replies))
    choices = [completion_choice(spec, a) for spec, a in zip(specs, answers, strict=True)]
    if req.prompt_logprobs is not None:  # vLLM's, per choice
        for choice, answer in zip(choices, answers, strict=True):
            choice["prompt_logprobs"] = prompt_logprobs(answer)
    return JSONResponse(fmt.completion(fmt.new_id("cmpl"), ctx.model_id(), choices, use),
                        headers=merged_headers(replies))


@router.post("/chat/completions", response_model=None, responses=_ERRORS)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    """Chat completion; the prompt is the messages rendered with the model's chat template."""
    warn = check_fields(get_ctx(request).settings, req, "/v1/chat/completions")  # unknown fields: 400 or a warning
    return with_headers(await _chat_completions(req, request), warn)


async def _chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    ctx = get_ctx(request).model(req.model)
    c = constraints(request, req.session_key(), ctx)
    check_new_tokens(ctx, req.max_new_tokens, "max_tokens")
    job = prepare_chat(ctx, req)  # template, tools, grammar, reasoning (server/edge/routes/_chat.py)
    specs, bodies = list(job.specs), list(job.bodies)
    if req.stream:
        return await _stream(ctx, c, request, bodies, specs, [0] * req.n, chat=True, usage=_include_usage(req))
    replies = await _generate_all(ctx, c, bodies)
    if (failed := _failed(request.url.path, replies)) is not None:
        return failed
    answers = [json.loads(r.content) for r in replies]
    choices = [chat_choice(spec, a) for spec, a in zip(specs, answers, strict=True)]
    body = fmt.chat_completion(fmt.new_id("chatcmpl"), ctx.model_id(), choices, _usage(answers, [0] * req.n))
    if req.prompt_logprobs is not None:  # vLLM's, once per response (the choices share the prompt)
        body["prompt_logprobs"] = prompt_logprobs(answers[0])
    return JSONResponse(body, headers=merged_headers(replies))


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _whole_stream(ctx: RouterContext, specs: list[ChoiceSpec], answers: list[dict], use: dict | None,
                  headers: dict[str, str]) -> Response:
    """Complete answers as one SSE body (completion chunks, usage, `[DONE]`)."""
    cid, created, model = fmt.new_id("cmpl"), int(time.time()), ctx.model_id()
    parts = [fmt.sse(fmt.completion_chunk(cid, created, model, delta))
             for spec, a in zip(specs, answers, strict=True) for delta in ChoiceStream(spec, chat=False).whole(a)]
    if use is not None:
        parts.append(fmt.sse(fmt.usage_chunk(cid, created, model, "text_completion", use)))
    parts.append("data: [DONE]\n\n")
    return Response("".join(parts), media_type="text/event-stream", headers=headers)


async def _stream(ctx: RouterContext, c: Constraints, request: Request, bodies: list[WorkerRequest],
                  specs: list[ChoiceSpec], prompt_of: list[int], chat: bool, usage: bool) -> Response:
    """One worker stream per choice, opened concurrently; a refusal of any is the answer."""
    opened = await asyncio.gather(*(open_client_stream(ctx.dispatcher, "/generate_stream", b, c) for b in bodies),
                                  return_exceptions=True)
    streams = [o for o in opened if isinstance(o, ClientStream)]
    problem = next((o for o in opened if not isinstance(o, ClientStream)), None)
    if problem is not None:
        for s in streams:
            await close_shielded(s)
        if isinstance(problem, BaseException):
            raise problem
        return (_failed(request.url.path, [problem])
                or Response(problem.content, problem.status, headers=problem.headers))
    choices = [ChoiceStream(spec, chat) for spec in specs]
    return RelayResponse(_relay(streams, choices, prompt_of, ctx, chat, usage), streams)


async def _pump(k: int, stream: ClientStream, queue: ByteQueue) -> None:
    """Stream k's event payloads into `queue` as (k, data); (k, None) at its end, (k, error) when
    no worker can finish it."""
    try:
        async for data in stream.events():
            await queue.put((k, data), len(data))
        await queue.put((k, None), 0)
    except StreamIncomplete as e:
        await queue.put((k, e), 0)


async def _merged(streams: list[ClientStream], pumps: list[asyncio.Task]):
    """Lists of (k, data | None | StreamIncomplete) as they come: every event that arrived
    together in one list. One stream (the common case, `n` = 1) is read directly, a batch of
    events per read; several go through one queue, drained of what is there at each wake-up."""
    if len(streams) == 1:
        try:
            async for raw in streams[0].batches():
                yield [(0, data) for data in split_events(raw)]
            yield [(0, None)]
        except StreamIncomplete as e:
            yield [(0, e)]
        return
    queue = ByteQueue(STREAM_BUFFER_BYTES)  # bounded: the pumps wait while the client does not read
    pumps += [asyncio.ensure_future(_pump(k, s, queue)) for k, s in enumerate(streams)]
    while True:
        yield await queue.get_all()


class ChunkFrames:
    """`data: <chunk>` frames of one response, the constant head of every chunk (id, object,
    created, model) serialized once: `frame(choice)` is what `fmt.sse(chunk(...))` gives."""

    __slots__ = ("_head",)

    def __init__(self, chunk, cid: str, created: int, model: str):
        self._head = "data: " + json.dumps(chunk(cid, created, model, {}))[: -len("{}]}")]

    def __call__(self, choice: dict) -> str:
        return f"{self._head}{json.dumps(choice)}]}}\n\n"


async def _relay(streams: list[ClientStream], choices: list[ChoiceStream], prompt_of: list[int], ctx: RouterContext,
                 chat: bool, usage: bool):
    """Worker token events -> OpenAI chunks of every choice, interleaved as they come (the chunks
    of events that arrived together go out as one write); usage and `[DONE]` at the end; an error
    event if a choice's stream cannot be finished by any worker."""
    cid, created, model = fmt.new_id("chatcmpl" if chat else "cmpl"), int(time.time()), ctx.model_id()
    obj, chunk = ("chat.completion.chunk", fmt.chat_chunk) if chat else ("text_completion", fmt.completion_chunk)
    frame = ChunkFrames(chunk, cid, created, model)
    pumps: list[asyncio.Task] = []
    merged = _merged(streams, pumps)
    live, lost, why, refused = len(streams), None, "the stream ended before its last event", None
    unreadable = False
    try:
        async for items in merged:
            out = []
            for k, data in items:
                if data is None or isinstance(data, BaseException):
                    live -= 1
                    if not choices[k].done and lost is None:
                        if isinstance(data, BaseException):
                            logger.warning("stream ends incomplete: %s", data)
                            why, refused = str(data), data if isinstance(data, StreamRefused) else None
                        lost = k
                    continue
                event = parse_event(data) or {}
                moves = (event.get("details") or {}).get("migrations")
                try:
                    deltas = choices[k].on_event(event)
                except Exception:  # the router's fault: the stream still ends with an error event
                    logger.exception("reading streamed choice %d's output failed", k)
                    lost, why, unreadable = k, UNREADABLE, True
                    break
                for delta in deltas:
                    if moves and delta.get("finish_reason"):
                        out.append(fmt.sse({**chunk(cid, created, model, delta), "migrations": moves}))
                    else:
                        out.append(frame(delta))
            if out:
                yield "".join(out)
            if not live or lost is not None:
                break
        if lost is None:
            if usage:
                prompts = {prompt_of[k]: ch.prompt_tokens for k, ch in enumerate(choices)}
                use = fmt.usage(sum(prompts.values()), sum(ch.completion_tokens for ch in choices))
                yield fmt.sse(fmt.usage_chunk(cid, created, model, obj, use))
            yield "data: [DONE]\n\n"
            return
    finally:
        await merged.aclose()
        for p in pumps:
            p.cancel()
        for s in streams:
            await close_shielded(s)
    if refused is None and not unreadable:  # a refusal (its grammar cannot end) is no stream error of the worker's
        ctx.metrics.stream_error(streams[lost].worker)
    kind = "internal" if unreadable else "incomplete_generation" if refused is None else refused.error_type
    yield fmt.sse({"error": {"message": why, "type": kind, "param": None, "code": None}})
