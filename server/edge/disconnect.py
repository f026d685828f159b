"""A client that goes away cancels its request, on every route, streamed or not.

Starlette notices a disconnect only while it streams a response; a non-streamed route (a
`/generate`, an OpenAI completion with `n` = 4) or a stream still waiting for its first
token would keep its worker busy until the generation ends. This pure-ASGI middleware
owns the request's `receive` once the app has read the whole body: one watcher waits for
`http.disconnect`, and if it comes before the response has started, the app's task is
cancelled. Cancelling closes the connection to the worker (`server/fleet/uds_http.py` never
reuses an interrupted one), and the worker aborts the request before its next engine step.
Later `receive` calls of the app (a streaming response listening for the disconnect) are
answered from the watcher. Trade-off: one extra task per request that has a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

logger = logging.getLogger(__name__)

_DISCONNECT = {"type": "http.disconnect"}


class DisconnectGuard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = asyncio.Event()
        state = {"body_read": False, "started": False, "done": False}
        app_task = asyncio.current_task()
        watcher: asyncio.Task | None = None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not state["started"] and not state["done"]:
                logger.info("client left %s %s before the answer; cancelling it", scope.get("method"),
                            scope.get("path"))
                app_task.cancel()

        async def guarded_receive():
            nonlocal watcher
            if state["body_read"]:
                await gone.wait()
                return _DISCONNECT
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                state["body_read"] = True
                watcher = asyncio.ensure_future(watch())
            return message

        async def guarded_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except asyncio.CancelledError:
            if not gone.is_set() or state["started"]:
                raise  # cancelled for another reason (shutdown): not ours to swallow
            app_task.uncancel()  # the client is gone: nobody reads an answer
        finally:
            state["done"] = True
            if watcher is not None and not watcher.done():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
