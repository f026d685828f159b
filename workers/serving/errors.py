"""The worker's error answers: `{"error", "error_type"}` with the status that says what to do.

422 `validation` (the request is wrong; naming the field), 429 `overloaded` (with
`Retry-After`), 503 `unavailable` (not ready, draining), 500 `internal` (see the worker's
log). The router reads `error_type` to decide whether another worker should be tried.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A refusal a route raises; the handler below answers it."""

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers


def error_response(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": error_type}, status_code=status, headers=headers)


def field_message(exc: RequestValidationError) -> str:
    """The first few validation errors, each naming its field: "`parameters.top_k`: ..."."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        parts.append(f"`{loc}`: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.error_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, field_message(exc), "validation")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("Unhandled error on %s", request.url.path)
        return error_response(500, "Internal error in the worker; see its log", "internal")
