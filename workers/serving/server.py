"""The serve step's server: the worker's HTTP app and uvicorn on its Unix socket.

Design: `WorkerServer` receives what the earlier steps built (workers/main.py: the engine over its
KV cache, workers/engine/build.py; the `/capability` description, workers/engine/describe.py) and
only serves it: tracing, the app (workers/serving/app.py), the socket, created 0600 so that only
the router, as the same user, reaches it, and beside it the engine channel's socket
(workers/serving/engine_channel.py), which carries every generation the router sends. `run()`
serves until SIGTERM, a fatal engine error or `stop()` (a pipeline stage gone), and `close()`
stops the engine and frees the sockets. Trade-off:
nothing here knows how the engine was built, so a pipeline's own shutdown (its stages, their
timings) is its first stage's, closed by workers/main.py after this server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

import uvicorn

from workers.contract import DRAIN_TIMEOUT_S, CapabilityPayload
from workers.contract.channel import channel_socket_path
from workers.contract.tracing import start_tracing
from workers.engine.core import Engine
from workers.engine.openmp import release_pool
from workers.serving.app import create_app
from workers.serving.engine_channel import EngineChannelServer
from workers.serving.headers import identity_headers

logger = logging.getLogger(__name__)


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket that is 0600 from its creation (umask), never world-reachable."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if p.is_socket():
            p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    finally:
        os.umask(old)
    os.chmod(p, 0o600)
    sock.listen(2048)
    return sock


def _loop_factory():
    """uvloop's event loop where it is installed (less CPU per request and per streamed event
    than asyncio's own; uvicorn's `loop="auto"` cannot choose it for a loop we start), else
    asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class WorkerServer:
    """The app and uvicorn on the worker's Unix socket, over an engine built by the earlier steps."""

    def __init__(self, socket_path: str, engine: Engine, tokenizer, info: CapabilityPayload,
                 otlp_endpoint: str | None = None):
        self.socket_path, self.engine, self.info = socket_path, engine, info
        self._stop_error: BaseException | None = None
        engine.on_fatal = self._on_fatal
        self.tracing = start_tracing(otlp_endpoint, "hetserve-worker", {"service.instance.id": info.worker_id or ""})
        self.app = create_app(info, engine, tokenizer, tracing=self.tracing)
        self.sock = bind_unix_socket(socket_path)
        self.channel_path = channel_socket_path(socket_path)
        self.channel = EngineChannelServer(self.app.state.ctx, bind_unix_socket(self.channel_path),
                                           identity_headers(info))
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on", proxy_headers=False,
                                timeout_graceful_shutdown=DRAIN_TIMEOUT_S)
        self.server = uvicorn.Server(config)
        self.app.state.ctx.stopping = lambda: self.server.should_exit  # the stream channels end then

    def stop(self, reason: str) -> None:
        """Stop serving as on a fatal engine error (a pipeline stage is gone: workers/pipeline/launch.py)."""
        logger.error("%s; the pipeline stops", reason)
        self._stop_error = RuntimeError(reason)
        self.server.should_exit = True

    def _on_fatal(self, exc: BaseException) -> None:
        """Engine thread: the model failed; stop serving so the router restarts this worker."""
        self.server.should_exit = True

    @property
    def fatal_error(self) -> BaseException | None:
        return self.engine.fatal_error or self._stop_error

    def run(self, on_ready) -> None:
        async def serve():
            await self.channel.start()  # refuses to open until the app is ready
            task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
            try:
                while not self.server.started and not task.done():
                    await asyncio.sleep(0.01)
                if self.server.started:
                    on_ready()
                    logger.info("ready on %s", self.socket_path)
                await task  # its shutdown drains the engine, whose streams the channel still carries
            finally:
                await self.channel.close()

        # this thread only serves from here on: its OpenMP pool would slow every region the engine starts
        logger.info("OpenMP: %s", release_pool())
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve())

    def close(self) -> None:
        """Stop the engine, flush the last spans and free the socket."""
        self.engine.shutdown(0.0)
        self.tracing.shutdown()
        self.sock.close()
        self.channel.sock.close()
        for path in (self.socket_path, self.channel_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
