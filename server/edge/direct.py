"""The generation routes without FastAPI's per-request machinery, for requests that are valid.

A generation request pays FastAPI's route matching over every route, its exit stacks, the
content-type parse through `email.message`, dependency solving and its exception middleware,
before the route's own work starts. `DirectRoutes` (pure ASGI, the innermost middleware) serves
the POST routes whose endpoint takes `(body model, Request)` and returns a `Response` (the
generation routes of every protocol) itself: it reads the body, parses the JSON and validates it
with the route's own model as FastAPI would (`model_validate` of the parsed value), calls the same
endpoint, and turns an exception into the answer of the app's own handler for it (looked up as
Starlette's exception middleware does). Anything else, and every request that does not parse or
validate, goes to FastAPI with its body replayed, so every refusal is FastAPI's own, byte for
byte; the body is then validated twice, which only refused requests pay. Trade-off: the route
table is read from FastAPI's routes once, at the first request, so a route added later is
served by FastAPI only.
"""

from __future__ import annotations

import inspect
import json

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

DIRECT_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                          "/v1/messages", "/v1/responses"})
_JSON_TYPES = (b"application/json",)


class DirectRoutes:
    """Serves `DIRECT_PATHS`' POST requests that validate; everything else goes to `app`."""

    def __init__(self, app, fastapi: FastAPI):
        self.app = app
        self.fastapi = fastapi
        self._table: dict[str, tuple[type[BaseModel], object]] | None = None
        self._handlers: dict[type, object] | None = None

    def _init_table(self) -> None:
        """Each direct path's (body model, endpoint), from FastAPI's own routes."""
        table = {}
        for route in _api_routes(self.fastapi.router.routes):
            if route.path in DIRECT_PATHS and route.methods == {"POST"} and route.path not in table:
                spec = _direct_spec(route)
                if spec is not None:
                    table[route.path] = spec
        self._table = table
        # as Starlette's exception middleware holds them: 500 and `Exception` are the outer layer's
        self._handlers = {k: v for k, v in self.fastapi.exception_handlers.items() if k not in (500, Exception)}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if self._table is None:
            self._init_table()
        spec = self._table.get(scope.get("path", ""))
        if spec is None or not _json_body(scope):
            await self.app(scope, receive, send)
            return
        model, endpoint = spec
        request = Request(scope, receive, send)
        try:
            body = await request.body()
        except Exception as e:  # the body's size limit (EdgeMiddleware), as FastAPI raises it
            await self._answer_exception(e, request, scope, receive, send, [False])
            return
        replay = _replay(body, receive)
        req = _validated(model, body)
        if req is None:  # FastAPI answers it (its refusal), from the same bytes
            await self.app(scope, replay, send)
            return
        request = Request(scope, replay, send)
        started = [False]

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            response = await endpoint(req, request)
            await response(scope, replay, tracked_send)
        except Exception as e:
            await self._answer_exception(e, request, scope, replay, tracked_send, started)

    async def _answer_exception(self, exc: Exception, request: Request, scope, receive, send, started) -> None:
        """The app's handler's answer for `exc`, or `exc` raised on (no handler here, or the
        response already started), as Starlette's exception middleware does."""
        handler = None
        for cls in type(exc).__mro__:
            handler = self._handlers.get(cls)
            if handler is not None:
                break
        if handler is None:
            raise exc
        if started[0]:
            raise RuntimeError("Caught handled exception, but response already started.") from exc
        response = await handler(request, exc)
        await response(scope, receive, send)


def _api_routes(routes):
    """The `APIRoute`s of an app's routes, through the routers included without a prefix, a
    dependency or a body limit of their own (any other is FastAPI's to serve)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
            continue
        included, context = getattr(route, "original_router", None), getattr(route, "include_context", None)
        if included is not None and context is not None and not context.prefix and not context.dependencies \
                and getattr(context, "max_body_size", None) is None and not included.dependencies:
            yield from _api_routes(included.routes)


def _direct_spec(route: APIRoute) -> tuple[type[BaseModel], object] | None:
    """(body model, endpoint) when the route is `async def f(req: Model, request: Request) -> Response`
    without dependencies; None otherwise (FastAPI serves it)."""
    endpoint = route.endpoint
    if not inspect.iscoroutinefunction(endpoint) or route.dependencies or route.dependant.dependencies:
        return None
    params = list(inspect.signature(endpoint, eval_str=True).parameters.values())
    returns = inspect.signature(endpoint, eval_str=True).return_annotation
    if len(params) != 2 or params[1].annotation is not Request or not (
            isinstance(returns, type) and issubclass(returns, Response)):
        return None
    model = params[0].annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)) or len(route.dependant.body_params) != 1:
        return None
    return model, endpoint


def _json_body(scope) -> bool:
    """Whether the request says its body is JSON (EdgeMiddleware gives one without a type this type)."""
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower() in _JSON_TYPES
    return False


def _validated(model: type[BaseModel], body: bytes) -> BaseModel | None:
    """The body as `model` (parsed, then validated as FastAPI does), None when it is not one."""
    if not body:
        return None
    try:
        value = json.loads(body)
        if not isinstance(value, dict):
            return None
        return model.model_validate(value, from_attributes=True)  # as FastAPI validates a body
    except (ValueError, ValidationError, RecursionError, TypeError):
        return None


def _replay(body: bytes, receive):
    """`receive` that gives the whole body first, then what the connection sends (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
