"""A client that goes away cancels its request, on every route, streamed or not.

Starlette notices a disconnect only while it streams a response; a non-streamed route (a
`/generate`, an OpenAI completion with `n` = 4) or a stream still waiting for its first
token would keep its worker busy until the generation ends. This pure-ASGI middleware
owns the request's `receive` once the app has read the whole body: one watcher waits for
`http.disconnect`, and if it comes before the response has started, the app's task is
cancelled. Cancelling closes the connection to the worker (`server/fleet/uds_http.py` never
reuses an interrupted one), and the worker aborts the request before its next engine step.
Later `receive` calls of the app (a streaming response listening for the disconnect) are
answered from the watcher. Under the router's own HTTP protocol (server/edge/http11.py) the
watcher is a callback the protocol calls when the connection is lost (`ClientGone`, in the
scope's extensions) instead of a task reading `receive`: the same moments, as uvicorn marks a
request disconnected only there, without a task started, stepped and cancelled per request.
Trade-off: under any other server, one extra task per request that has a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

logger = logging.getLogger(__name__)

_DISCONNECT = {"type": "http.disconnect"}
CLIENT_GONE_EXTENSION = "hetserve.client_gone"


class ClientGone:
    """The callbacks to run when a request's client goes away (its connection lost, or the edge
    closed it), set in the request's scope by the HTTP protocol; one that comes after it is run
    at once."""

    __slots__ = ("_callbacks", "fired")

    def __init__(self):
        self._callbacks: list = []
        self.fired = False

    def add(self, callback) -> None:
        if self.fired:
            callback()
        else:
            self._callbacks.append(callback)

    def discard(self, callback) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()


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
        client_gone: ClientGone | None = (scope.get("extensions") or {}).get(CLIENT_GONE_EXTENSION)

        def left() -> None:
            gone.set()
            if not state["started"] and not state["done"]:
                logger.info("client left %s %s before the answer; cancelling it", scope.get("method"),
                            scope.get("path"))
                app_task.cancel()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            left()

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
                if client_gone is not None:
                    client_gone.add(left)
                else:
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
            if client_gone is not None:
                client_gone.discard(left)
            if watcher is not None and not watcher.done():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
