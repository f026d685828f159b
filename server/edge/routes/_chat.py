"""One chat request -> its prompt, worker requests and choice specs; one choice relayed to a writer.

Chat completions, Responses and Messages are three shapes of one thing: messages rendered
with the model's chat template, sampled by a worker, read back through the reasoning parser
(server/protocol/reasoning.py, harmony) and the model's tool-call format
(server/protocol/tool_parsers/). `prepare_chat` makes that decision once, from a validated
`ChatCompletionRequest` (Responses and Messages translate their requests into one first), so
the three routes render, constrain and parse identically; each route only shapes the answer.
`relay_choice` streams one choice's deltas through a route's event writer (Responses' typed
events, Anthropic's), ending with the writer's error event when no worker can finish it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from fastapi.responses import Response

from server.dispatch.dispatcher import WorkerReply
from server.dispatch.migration import ClientStream, StreamIncomplete, parse_event
from server.edge.context import ModelContext
from server.edge.errors import error_response
from server.edge.routes._common import close_shielded, to_worker
from server.protocol.harmony import HarmonyPlan, plan_harmony
from server.protocol.openai import responses as fmt
from server.protocol.openai.choices import ChoiceSpec, ChoiceStream
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.openai.tools import AUTO, plan_tools, response_grammar, template_messages
from server.protocol.reasoning import add_reasoning, choose_parser, plan_reasoning
from server.protocol.tool_parsers.choose import choose_tool_parser
from workers.contract import MAX_SEED, GenerationParameters, WorkerRequest

logger = logging.getLogger(__name__)
UNREADABLE = "the server could not read the model's output (see its log)"


@dataclass(frozen=True)
class ChatJob:
    """A chat request ready to send: the rendered prompt, one worker body and spec per choice."""

    prompt: str
    bodies: tuple[WorkerRequest, ...]
    specs: tuple[ChoiceSpec, ...]


def choice_request(prompt: str | list[int], params: GenerationParameters, k: int = 0) -> WorkerRequest:
    """Choice k's request: the prompt as text or token ids, and the request's seed + k (wrapping
    within the seeds a worker takes), so choices differ yet stay reproducible."""
    if k and params.seed is not None:
        params = params.model_copy(update={"seed": (params.seed + k) % (MAX_SEED + 1)})
    if isinstance(prompt, str):
        return WorkerRequest(inputs=prompt, parameters=params)
    return WorkerRequest(input_ids=prompt, parameters=params)


def render_prompt(ctx: ModelContext, req: ChatCompletionRequest, add_generation_prompt: bool = True) -> str:
    """The chat template over the request's messages, its tools and template keywords."""
    template = ctx.chat_template()
    plan = plan_tools(req)
    extra = {"tools": [{"type": "function", "function": f} for f in plan.functions]} if plan.functions else {}
    messages = add_reasoning(template_messages(req, "tools" in template.source),
                             [m.reasoning_text() for m in req.messages])
    return template.render(messages, add_generation_prompt=add_generation_prompt, **req.template_kwargs(), **extra)


def prepare_chat(ctx: ModelContext, req: ChatCompletionRequest) -> ChatJob:
    """The prompt (template, tools, reasoning of earlier turns, template keywords), the worker
    parameters (sampling, grammar, logprobs) and how each choice is read back."""
    template = ctx.chat_template()
    tool_parser = choose_tool_parser(ctx.settings.protocol.tool_call_parser, template.source, template.model_type)
    plan = replace(plan_tools(req), syntax=tool_parser.syntax)
    kwargs = req.template_kwargs()
    prompt = render_prompt(ctx, req)
    grammar = to_worker(lambda: plan.grammar() or response_grammar(req))  # tools' or the response format's
    params = to_worker(lambda: req.sampling(req.max_new_tokens, ctx.sampling_defaults(), top_n_tokens=req.top_n,
                                            grammar=grammar))
    parser = choose_parser(ctx.settings.reasoning_parser, template.source, template.model_type)
    reasoning = plan_reasoning(parser, prompt, kwargs, constrained=grammar is not None)
    if tool_parser.harmony and plan.mode == AUTO and not isinstance(reasoning, HarmonyPlan):
        reasoning = plan_harmony(prompt, grammar is not None)  # `--tool-call-parser openai`: read harmony
    specs = tuple(ChoiceSpec(k, req.top_n, tools=plan, reasoning=reasoning) for k in range(req.n))
    bodies = tuple(choice_request(prompt, params, k) for k in range(req.n))
    return ChatJob(prompt, bodies, specs)


def worker_failure(path: str, reply: WorkerReply) -> Response:
    """A worker's refusal or error as this route's error shape (429 keeps `Retry-After`)."""
    message, kind = fmt.worker_error(reply.content)
    headers = dict(reply.headers)
    if reply.status == 429:
        headers["retry-after"] = "1"
    return error_response(path, reply.status, message, kind, headers)


class EventWriter(Protocol):
    """A route's stream shape: chat choice deltas in, its SSE frames out."""

    def deltas(self, deltas: list[dict], choice: ChoiceStream) -> str: ...

    def failed(self, message: str) -> str: ...


async def relay_choice(stream: ClientStream, choice: ChoiceStream, writer: EventWriter, ctx: ModelContext):
    """One choice's worker events -> the writer's frames, as they come; the writer's error
    frame when no worker can finish the stream, or when its output cannot be read (a fault of
    the router's, not the worker's: the stream still ends with an error event, never cut)."""
    try:
        async for data in stream.events():
            try:
                frames = writer.deltas(choice.on_event(parse_event(data) or {}), choice)
            except Exception:
                logger.exception("reading a streamed choice's output failed")
                yield writer.failed(UNREADABLE)
                return
            if frames:
                yield frames
            if choice.done:
                return
        why = "the stream ended before its last event"
    except StreamIncomplete as e:
        logger.warning("stream ends incomplete: %s", e)
        why = str(e)
    finally:
        await close_shielded(stream)
    ctx.metrics.stream_error(stream.worker)
    yield writer.failed(why)
