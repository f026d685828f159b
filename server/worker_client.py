"""HTTP to one worker over its Unix socket (httpx, one pooled client per worker).

The worker's socket API mirrors the public one (TGI shapes), so the router forwards request
bodies and streamed events mostly untouched. A worker that dies shows up here as an
`httpx.TransportError` (connection refused, reset, or closed mid-response); the dispatcher
turns that into a retry or an error event. Reads have no timeout (a long generation is not
a failure); a hung worker is caught by the supervisor's health checks instead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

# Generation reads are unbounded; connecting and control calls are not.
_GENERATE_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0)
_CONTROL_TIMEOUT = httpx.Timeout(5.0)
_LIMITS = httpx.Limits(max_connections=4096, max_keepalive_connections=256)

# Errors that mean "the worker is gone or went away mid-answer" (not a bad request).
WorkerGone = (httpx.TransportError,)


class WorkerClient:
    """Talks to one worker socket. Cheap to keep; `aclose()` when the worker is replaced."""

    def __init__(self, socket_path: Path | str):
        self.socket_path = str(socket_path)
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self.socket_path, limits=_LIMITS),
            base_url="http://worker",
            timeout=_GENERATE_TIMEOUT,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    # --- control -----------------------------------------------------------------------
    async def health(self) -> tuple[int, dict]:
        """(status code, body) of GET /health; raises `WorkerGone` when unreachable."""
        r = await self._client.get("/health", timeout=_CONTROL_TIMEOUT)
        return r.status_code, _json_or_empty(r.content)

    async def capability(self) -> dict:
        r = await self._client.get("/capability", timeout=_CONTROL_TIMEOUT)
        r.raise_for_status()
        return r.json()

    async def metrics(self) -> str:
        r = await self._client.get("/metrics", timeout=_CONTROL_TIMEOUT)
        r.raise_for_status()
        return r.text

    # --- generation --------------------------------------------------------------------
    async def post(self, path: str, body: dict) -> httpx.Response:
        """A non-streamed call; the whole answer is read before returning."""
        return await self._client.post(path, content=json.dumps(body).encode(), headers=_JSON)

    @asynccontextmanager
    async def stream(self, path: str, body: dict) -> AsyncIterator[httpx.Response]:
        """A streamed call; the response's body is read by the caller inside the block."""
        request = self._client.build_request("POST", path, content=json.dumps(body).encode(), headers=_JSON)
        response = await self._client.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()


_JSON = {"content-type": "application/json"}


def _json_or_empty(content: bytes) -> dict:
    try:
        value = json.loads(content)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def iter_sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a Server-Sent-Events body, one string per event.

    Events end at a blank line; several `data:` lines of one event are joined with "\\n"
    (the SSE rule). Comments and other fields are skipped.
    """
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:  # a last event without its blank line (the stream was cut short)
        yield "\n".join(data)
