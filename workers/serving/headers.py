"""The worker's identity on every answer: X-Worker-Id, X-Worker-Capability, X-Fp8-Convention.

A pure ASGI middleware adds them to every response start, so streamed responses get them too
and no route can forget them; the router passes them on to the client.
"""

from __future__ import annotations

from workers.contract import (
    HEADER_FP8_CONVENTION,
    HEADER_WORKER_CAPABILITY,
    HEADER_WORKER_ID,
    CapabilityPayload,
)


def identity_headers(info: CapabilityPayload) -> dict[str, str]:
    """X-Worker-Id, X-Worker-Capability ("9.0" or "cpu") and X-Fp8-Convention of this worker: the
    convention its fp8 layers run in, or `not used (bfloat16)` where none computes in fp8."""
    return {
        HEADER_WORKER_ID: info.worker_id or "",
        HEADER_WORKER_CAPABILITY: info.device.capability or "cpu",
        HEADER_FP8_CONVENTION: info.fp8.label or info.fp8.convention or "",  # "not used (bfloat16)" unless used
    }


class WorkerHeaders:
    """Pure ASGI middleware: the worker's identity headers on every HTTP response."""

    def __init__(self, app, headers: dict[str, str]):
        self.app = app
        self.raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.raw]}
            await send(message)

        return await self.app(scope, receive, send_with_headers)
