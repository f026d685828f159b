"""The worker's error answers: `{"error", "error_type"}` with the status that says what to do.

422 `validation` (the request is wrong; naming the field), 429 `overloaded` (with
`Retry-After`), 503 `unavailable` (not ready, draining), 500 `request_failed` (processing this
request raised: logged with its traceback, and the worker serves on), 500 `internal` (the
engine failed). The router reads `error_type` to decide whether another worker should be
tried and whether the worker is at fault (workers/contract/errors.py): a request fault is
neither retried nor counted against the worker's breaker. Every message goes out through
`safe_message` (a client's value quoted at most 64 characters, always encodable).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from workers.contract.errors import ERROR_REQUEST_FAILED, safe_message
from workers.contract.request import request_error

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A refusal a route raises; the handler below answers it."""

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers


def error_response(status: int, message: str, error_type: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": safe_message(message), "error_type": error_type}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.error_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(422, request_error(exc.errors()), "validation")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("Unhandled error on %s (this request only: the worker serves on)", request.url.path)
        return error_response(500, f"Processing the request failed on the worker ({type(exc).__name__}); see its "
                                   "log", ERROR_REQUEST_FAILED)
