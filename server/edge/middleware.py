"""The HTTP edge as one pure-ASGI middleware: API key, HEAD, body size limit, request metrics.

Pure ASGI (not `BaseHTTPMiddleware`) so streamed responses pass through untouched and the
per-request cost stays a few dict lookups. `--api-key` guards everything but `/health`
(load balancers and orchestrators probe it without credentials) and the status page's shell
(`GET /`, `GET /status`: no data in it); the key comes as `Authorization: Bearer KEY` (the
scheme matched in any case, RFC 9110) or as `x-api-key: KEY` (Anthropic's clients), and is
compared in constant time. `HEAD` is answered as `GET` without a body
(`curl -I` health checks). Bodies over the limit get 413 from the `Content-Length` header or, for
chunked bodies, as soon as the running count passes it. Metrics label each request with its
route template among the known ones (anything else is `other`, so a fuzzer or a scanner
cannot blow up the label set) and its status, timed to the last byte of the response.
"""

from __future__ import annotations

import hmac
import json
import time

from starlette.exceptions import HTTPException as StarletteHTTPException

from server.edge.errors import error_body
from server.errors import shown
from server.fleet.metrics import RouterMetrics

PUBLIC_PATHS = frozenset({"/health"})
# The status page's shell holds no data (it asks for the key, then calls the API with it).
PUBLIC_PAGES = frozenset({"/", "/status"})
KNOWN_ROUTES = frozenset({
    "/", "/generate", "/generate_stream", "/info", "/health", "/metrics", "/workers", "/status", "/stats",
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/docs", "/openapi.json",
    "/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize",
})


class _BodyTooLarge(StarletteHTTPException):
    """Raised from `receive`: FastAPI re-raises HTTP exceptions from body parsing as they are."""

    def __init__(self, limit: int):
        super().__init__(413, f"The request body exceeds {limit} bytes")


def route_label(path: str) -> str:
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/workers/"):
        return "/workers/{id}"
    return "other"


class EdgeMiddleware:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: RouterMetrics | None = None):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        started = time.perf_counter()
        status_box = [0]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                if self.metrics is not None:
                    self.metrics.observe(route_label(path), status_box[0], time.perf_counter() - started)
            await send(message)

        # 1. API key (everything but /health)
        if self.expected is not None and not _public(scope, path) and not self._authorized(scope):
            await _json(send_wrapper, path, 401, "Missing or wrong API key: send `Authorization: Bearer <key>` "
                        "or `x-api-key: <key>`", {"www-authenticate": "Bearer"})
            return
        # 2. HEAD is GET without a body (the server writes no body for a HEAD request either)
        if scope.get("method") == "HEAD":
            scope = {**scope, "method": "GET"}
            send_wrapper = _without_body(send_wrapper)
        # 3. a POST without a JSON content type (`curl -d`) is read as JSON all the same
        if scope.get("method") == "POST":
            scope = _json_content_type(scope)
        # 4. body size: declared length first, then the running count of a chunked body
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_body_bytes
            except ValueError:
                await _json(send_wrapper, path, 400,
                            f"Invalid Content-Length `{shown(declared.decode(errors='replace'))}`")
                return
            if too_large:
                await _json(send_wrapper, path, 413, self._too_large_message())
                return
        received = 0

        async def receive_wrapper():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except _BodyTooLarge:
            if status_box[0] == 0:
                await _json(send_wrapper, path, 413, self._too_large_message())

    def _too_large_message(self) -> str:
        return f"The request body exceeds {self.max_body_bytes} bytes"

    def _authorized(self, scope) -> bool:
        key = _header(scope, b"x-api-key")  # Anthropic's clients send the key this way
        if key is not None and hmac.compare_digest(key.strip(), self.expected):
            return True
        given = _header(scope, b"authorization")
        if given is None:
            return False
        scheme, _, token = given.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


def _without_body(send):
    """`send` for a HEAD request: the GET response's status and headers, an empty body."""

    async def send_head(message):
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head


def _public(scope, path: str) -> bool:
    return path in PUBLIC_PATHS or (path in PUBLIC_PAGES and scope.get("method") in ("GET", "HEAD"))


_FORM = (b"application/x-www-form-urlencoded", b"text/plain")


def _json_content_type(scope):
    """The scope with `content-type: application/json` when none or a form/plain type was sent."""
    ctype = _header(scope, b"content-type")
    if ctype is not None and ctype.split(b";")[0].strip().lower() not in _FORM:
        return scope
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


async def _json(send, path: str, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(path, status, message)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
