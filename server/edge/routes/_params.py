"""Request fields hetserve does not implement: a 400 naming them, or a `Warning` header.

The request model of every route but TGI's (OpenAI, Responses, Messages, embeddings, the tokenizer
routes) keeps the fields it does not declare (`EdgeRequest`, server/protocol/base.py);
`check_fields` looks at them before anything is sent to a worker.
By default they are refused (400, the field names in backticks), since a client that asked
for something and got an answer without it is misled; `--lenient-params` turns that into
`Warning: 299 hetserve "..."` on the answer (and a log line), for clients that cannot be
changed. A field whose value is null asks for nothing and is neither refused nor warned about.
"""

from __future__ import annotations

import logging

from fastapi.responses import Response
from pydantic import BaseModel

from server.config.settings import RouterSettings
from server.dispatch.dispatcher import DispatchError
from server.errors import shown
from server.protocol.base import unknown_fields

logger = logging.getLogger(__name__)

MAX_NAMED = 8  # fields listed in one message


def check_fields(settings: RouterSettings, req: BaseModel, route: str) -> dict[str, str]:
    """The answer's extra headers (a warning, with `--lenient-params`); `DispatchError` 400 for
    unimplemented fields otherwise."""
    names = unknown_fields(req)
    if not names:
        return {}
    listed = ", ".join(f"`{shown(n)}`" for n in names[:MAX_NAMED]) + (" ..." if len(names) > MAX_NAMED else "")
    if settings.protocol.lenient_params:
        logger.warning("%s: ignored unsupported fields %s (--lenient-params)", route, listed)
        text = f"Unsupported fields ignored: {listed}".encode("ascii", "replace").decode().replace('"', "'")
        return {"warning": f'299 hetserve "{text}"'}
    raise DispatchError(400, f"{route} does not implement {listed}. Accepted: the fields of {route} in /docs "
                             "(or start the server with --lenient-params to answer with a warning instead)",
                        "invalid_request_error")


def with_headers(response: Response, headers: dict[str, str]) -> Response:
    """`response` with `headers` added (a stream's too: its head has not been sent yet)."""
    for name, value in headers.items():
        response.headers[name] = value
    return response
