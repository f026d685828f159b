"""Helpers the route modules share: constraints and the model, the context-length check, the
contract's request as a 422 where it refuses, stream relays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from server.dispatch.dispatcher import DispatchError
from server.dispatch.migration import ClientStream
from server.edge.context import ModelContext, RouterContext, get_ctx
from server.errors import shown
from server.routing.filter import MAX_SESSION_CHARS, Constraints, parse_constraints
from workers.contract import HEADER_MODEL, HEADER_PIN_WORKER, request_error

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
T = TypeVar("T")


def constraints(request: Request, user: str | None = None, model: str | ModelContext | None = None) -> Constraints:
    """Routing constraints from the `X-Hetserve-*` headers (`ConstraintError` -> 422), the
    session from `X-Session-Id` or else the OpenAI `user` field, and the request's model (a
    `ModelContext` brings its LoRA adapter too, which the dispatcher puts in the worker request)."""
    if isinstance(model, ModelContext):
        lora, model = model.lora, model.name
        if lora is not None:
            return replace(constraints(request, user, model), lora=lora)
    c = parse_constraints(request.headers)
    if c.worker is not None:
        _check_pinned(get_ctx(request), c.worker)
    if c.session is None and user:
        c = replace(c, session=user.strip()[:MAX_SESSION_CHARS] or None)
    return replace(c, model=model) if model is not None else c


def _check_pinned(ctx: RouterContext, worker: str) -> None:
    """422 naming the ids when `X-Hetserve-Worker` names no worker (by id, device index or UUID),
    rather than the filter's sentence about every worker's id, index and UUID."""
    if not any(h.answers_to(worker) for h in ctx.supervisor.workers.values()):
        known = ", ".join(ctx.supervisor.workers) or "none"
        raise DispatchError(422, f"No worker `{shown(worker)}` ({HEADER_PIN_WORKER}). Known: {known} (or a device "
                                 "index or UUID)", "validation")


def tgi_model(request: Request) -> ModelContext:
    """The model a TGI-shaped request is for: `X-Hetserve-Model`, else the default."""
    return get_ctx(request).model((request.headers.get(HEADER_MODEL.lower()) or "").strip() or None)


def check_new_tokens(ctx: RouterContext | ModelContext, value: int | None, name: str) -> None:
    """422 when more new tokens are asked for than the model's context holds."""
    limit = ctx.context_length()
    if value is not None and limit is not None and value > limit:
        raise DispatchError(422, f"`{name}` = `{value}` exceeds the model's context length ({limit} tokens)",
                            "validation")


def to_worker(build: Callable[[], T]) -> T:
    """What `build` translates a public request into (the contract's `WorkerRequest` or its
    parameters); a value the contract refuses (a combination the public shape does not check)
    is a 422 with the contract's message, before any worker is asked."""
    try:
        return build()
    except ValidationError as e:
        raise DispatchError(422, request_error(e.errors()), "validation") from e
    except ValueError as e:
        raise DispatchError(422, str(e), "validation") from e


async def close_shielded(stream: ClientStream) -> None:
    """Close the worker stream even while the client's request is being cancelled."""
    with anyio.CancelScope(shield=True):
        await stream.aclose()


def merged_headers(sources) -> dict[str, str]:
    """Worker headers of several answers (replies or streams): distinct values, comma-separated."""
    merged: dict[str, list[str]] = {}
    for source in sources:
        for name, value in source.headers.items():
            if value not in merged.setdefault(name, []):
                merged[name].append(value)
    return {name: ",".join(values) for name, values in merged.items()}


class RelayResponse(StreamingResponse):
    """A streamed relay that closes its worker streams however the response ends, even when
    the client goes away before the body generator has started (then its `finally` never runs)."""

    def __init__(self, content, streams: ClientStream | list[ClientStream], **kwargs):
        self._streams = streams if isinstance(streams, list) else [streams]
        super().__init__(content, media_type="text/event-stream",
                         headers={**merged_headers(self._streams), **SSE_HEADERS}, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                await close_shielded(stream)
