"""The worker's HTTP app on its Unix socket: what the router (and only the router) calls.

Design: `create_app()` is a factory over a ready engine (no model work at import), in FastAPI's
"bigger applications" shape: the routes (workers/serving/routes/: generation, health and
capability, metrics, tokens, embeddings, in TGI's shapes) reach the worker's state through one
`WorkerContext` on `app.state.ctx`; errors are `{"error", "error_type"}` (422, 429 with
Retry-After, 503, 500) and every response carries the worker's identity headers
(workers/serving/headers.py). The engine thread starts in the lifespan and stops there, draining
in-flight requests for up to `drain_timeout` seconds. Trade-off: FastAPI's request path costs
more per request than a bare ASGI route, for validation and one shape shared with the router."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from workers.contract import DRAIN_TIMEOUT_S, CapabilityPayload
from workers.contract.detokenize import TokenBytes, special_token_ids
from workers.contract.tracing import NO_TRACING, Tracing, fastapi_telemetry_off
from workers.engine.core import Engine
from workers.sampling.grammar import Grammars
from workers.serving.context import WorkerContext
from workers.serving.errors import install_error_handlers
from workers.serving.headers import WorkerHeaders, identity_headers
from workers.serving.routes import embed, generate, health, lora, tokens
from workers.serving.tracing import RequestTracer


def create_app(info: CapabilityPayload, engine: Engine, tokenizer, *, drain_timeout: float = DRAIN_TIMEOUT_S,
               tracing: Tracing = NO_TRACING) -> FastAPI:
    """The worker's app over a ready engine; `info` is its `/capability` answer but for `pid`
    and `load`, which are filled in per request. `tracing`: one span per generation request.
    The engine's grammar engine compiles constrained requests (made from `tokenizer` when the
    engine has none)."""
    if engine.grammars is None:
        engine.grammars = Grammars.for_tokenizer(tokenizer, None, engine.scheduler.config.eos_token_ids)
    grammars = engine.grammars
    ctx = WorkerContext(info, engine, tokenizer, grammars,
                        TokenBytes(grammars.tokenizer.decode_bytes, special_token_ids(tokenizer)),
                        RequestTracer(tracing, info))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        ctx.status = "ready"
        try:
            yield
        finally:
            ctx.status = "draining"
            await asyncio.to_thread(engine.shutdown, drain_timeout)
            grammars.close()  # the grammar compile children

    app = FastAPI(title="hetserve worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  **fastapi_telemetry_off())
    app.add_middleware(WorkerHeaders, headers=identity_headers(info))
    app.state.ctx = ctx
    install_error_handlers(app)
    for module in (generate, health, tokens, embed, lora):
        app.include_router(module.router)
    return app
