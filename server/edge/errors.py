"""Every error the public API answers is JSON: no HTML page, no stack trace.

Three shapes, each the one its clients parse: TGI routes (and everything outside `/v1`) answer
`{"error": "<message>", "error_type": "<kind>"}`; OpenAI routes (`/v1/...`, and vLLM's
`/tokenize` and `/detokenize`) answer `{"error": {"message", "type", "param", "code"}}`;
Anthropic's (`/v1/messages...`) answer `{"type": "error", "error": {"type", "message"}}`.
Validation messages name the field in backticks (`parameters.temperature`). An unknown model
is OpenAI's 404 `model_not_found` (`error_type` on TGI routes); a router-made answer for a
model names it in `X-Hetserve-Model`, also a 422 the edge gives before any worker sees the
request (the model it names, else the default: `model_header`). Unexpected exceptions are
logged with their traceback and answered with a generic 500 message.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.dispatch.dispatcher import DispatchError
from server.errors import shown
from server.fleet.models import ModelUnavailable
from server.protocol.chat import ChatTemplateError
from server.routing.filter import ConstraintError
from workers.contract import HEADER_MODEL
from workers.contract.errors import safe_message
from workers.contract.json_schema import MAX_JSON_DEPTH

logger = logging.getLogger(__name__)

_KINDS = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type", 422: "validation", 429: "overloaded",
    500: "internal", 503: "unavailable",
}
_OPENAI_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 422: "invalid_request_error",
    429: "rate_limit_error", 503: "service_unavailable",
}


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error",
}


def error_kind(status: int) -> str:
    return _KINDS.get(status, "internal" if status >= 500 else "bad_request")


def error_body(path: str, status: int, message: str, error_type: str | None = None) -> dict:
    """The JSON error for `path` (OpenAI shape under /v1, TGI shape elsewhere); the message as
    `safe_message` makes it (a client's value quoted at most 64 characters, always encodable)."""
    kind = error_type or error_kind(status)
    message = safe_message(message)
    if path.startswith(ANTHROPIC_PREFIX):  # Anthropic's shape, which its clients parse
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                                          else "invalid_request_error"),
                                           "message": message}}
    if path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize"):  # vLLM's routes: OpenAI's shape
        return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, kind), "param": None, "code": status}}
    return {"error": message, "error_type": kind}


def error_response(path: str, status: int, message: str, error_type: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, error_type), status_code=status, headers=headers)


_BODY_ROUTES = ("/v1/", "/tokenize", "/detokenize")  # the model is the body's `model` field
_HEADER_ROUTES = ("/generate", "/generate_stream")  # and TGI's `POST /`: the model is the header's
_UNREAD = object()


def model_header(request: Request, body: object = _UNREAD) -> dict[str, str] | None:
    """`X-Hetserve-Model` for an error on a route that serves a model, when the request's model
    is known here: on OpenAI's routes the body's `model` field (else the default; unknown when
    the body was not read), on TGI's the header (else the default); None elsewhere, or for a
    model this router does not offer (its 404 names none)."""
    path = request.url.path
    if path.startswith(_BODY_ROUTES) and path != "/v1/models":
        if body is _UNREAD:
            return None
        name = body.get("model") if isinstance(body, dict) else None
        name = name.strip() or None if isinstance(name, str) else None
    elif path in _HEADER_ROUTES or (path == "/" and request.method == "POST"):
        name = (request.headers.get(HEADER_MODEL.lower()) or "").strip() or None
    else:
        return None
    ctx = getattr(request.app.state, "ctx", None)
    try:
        return None if ctx is None else {HEADER_MODEL: ctx.model(name).name}
    except ModelUnavailable:
        return None


def _field(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def validation_message(errors) -> str:
    """'`parameters.temperature`: Input should be greater than 0; ...' (first five problems)."""
    msgs = []
    for err in list(errors)[:5]:
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            msgs.append(f"The body is not valid JSON: {err.get('ctx', {}).get('error', msg)}")
        elif err.get("type") == "missing":
            msgs.append(f"`{_field(err.get('loc', ()))}` is required")
        else:
            msgs.append(f"`{_field(err.get('loc', ()))}`: {msg}")
    return "; ".join(msgs) or "Invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"No route `{request.method} {shown(request.url.path)}`"
        elif exc.status_code == 405:
            message = f"Method `{request.method}` is not allowed on `{shown(request.url.path)}`"
        return error_response(request.url.path, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, 422, validation_message(exc.errors()), "validation",
                              model_header(request, exc.body))

    @app.exception_handler(DispatchError)
    async def _dispatch(request: Request, exc: DispatchError):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
        if exc.model is not None:
            headers[HEADER_MODEL] = exc.model
        return error_response(request.url.path, exc.status, exc.message, exc.error_type, headers or None)

    @app.exception_handler(ModelUnavailable)
    async def _model(request: Request, exc: ModelUnavailable):
        if exc.status == 404:  # OpenAI's shape for an unknown model, which its clients raise as NotFoundError
            if request.url.path.startswith("/v1/"):
                return JSONResponse({"error": {"message": exc.message, "type": "invalid_request_error",
                                               "param": "model", "code": "model_not_found"}}, status_code=404)
            return error_response(request.url.path, 404, exc.message, "model_not_found")
        retry_after = exc.retry_after or request.app.state.ctx.settings.retry_after_s
        headers = {"Retry-After": str(retry_after)} if exc.status == 503 else None
        return error_response(request.url.path, exc.status, exc.message, _KINDS.get(exc.status), headers)

    @app.exception_handler(ConstraintError)
    async def _constraint(request: Request, exc: ConstraintError):
        return error_response(request.url.path, 422, str(exc), "validation", model_header(request))

    @app.exception_handler(ChatTemplateError)
    async def _template(request: Request, exc: ChatTemplateError):
        return error_response(request.url.path, 422, str(exc), "validation", model_header(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        if isinstance(exc, RecursionError):  # a value nested past what any check bounded: the request's fault
            logger.warning("request on %s nests too deeply: %s", request.url.path, exc)
            return error_response(request.url.path, 422, f"The request nests too deeply. Accepted: at most "
                                                         f"{MAX_JSON_DEPTH} levels of objects and arrays", "validation")
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, "Internal server error (see the server log)", "internal")
