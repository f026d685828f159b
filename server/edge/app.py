"""The router's public FastAPI application.

`create_app(settings, devices)` builds the app; its `lifespan` starts the supervisor (one
worker per device) and, on shutdown, stops it after uvicorn has drained in-flight requests.
Startup does not wait for workers to be ready (loading a model takes a while): `/health`
answers 503 until one is, and requests arriving meanwhile wait a bounded time for one.
Routes are grouped by concern in `server/edge/routes/`; all reach the run's state through
`RouterContext` (`server/edge/context.py`) on `app.state.ctx`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server.canary.monitor import CanaryMonitor, run_canary
from server.config.settings import RouterSettings
from server.dispatch.dispatcher import Dispatcher
from server.dispatch.handoff import disaggregation
from server.edge.context import VERSION, RouterContext
from server.edge.direct import DirectRoutes
from server.edge.disconnect import DisconnectGuard
from server.edge.errors import install_error_handlers
from server.edge.middleware import EdgeMiddleware
from server.edge.routes import anthropic, docs, generate, health, openai, responses, status, tokenize, workers
from server.edge.routes import embeddings as embedding_routes
from server.edge.routes import lora as lora_routes
from server.edge.routes import metrics as metrics_routes
from server.edge.routes import models as model_routes
from server.edge.tracing import TracingMiddleware
from server.fleet.history import WorkerStats
from server.fleet.metrics import ForeignCastCollector, RouterMetrics
from server.fleet.models import ModelCollector, ModelManager
from server.fleet.supervisor import Supervisor
from server.routing.metrics import RoutingCollector
from server.routing.router import Router
from workers.contract import DeviceInfo, WorkerState
from workers.contract.tracing import Tracing, fastapi_telemetry_off, start_tracing

logger = logging.getLogger(__name__)


def ready_summary(supervisor: Supervisor) -> str:
    """`gpu0 (8.0, fp8: not used (bfloat16)), gpu1 (8.9, fp8: native_e4m3)` (ready workers: fp8 as
    it runs, server/fleet/handle.py `fp8_label`) + failed ones."""
    parts = []
    for h in supervisor.workers.values():
        if h.state == WorkerState.READY:
            stages = (h.info.pipeline or {}).get("stages") if h.info is not None else None
            if stages:  # a pipeline replica: each stage's device and layers
                parts.append(f"{h.id} pipeline of {len(stages)} stages: " + " + ".join(
                    f"{s['device'].get('capability', '?')} layers {s['layers'][0]}:{s['layers'][1]}" for s in stages))
                continue
            parts.append(f"{h.id} ({h.capability_label}, fp8: {h.fp8_label})")
        else:
            parts.append(f"{h.id} {h.state}: {h.reason}")
    return ", ".join(parts)


def create_app(settings: RouterSettings, devices: list[DeviceInfo],
               on_settled: Callable[[Supervisor], None] | None = None, tracing: Tracing | None = None,
               models: ModelManager | None = None) -> FastAPI:
    """The public app; `on_settled(supervisor)` runs once every worker is ready or failed.
    `tracing`: the router's spans (default: from `settings.otlp_endpoint`, off without one).
    `models`: the models and their placement (default: from the settings; `PlacementError`, a
    usage error, when they do not fit the devices)."""
    models = models or ModelManager(settings, devices)
    supervisor = Supervisor(devices, settings, models.assignment(), models.placement.pipelines)
    models.attach(supervisor)

    def handles() -> list:
        return list(supervisor.workers.values())

    metrics = RouterMetrics(handles)
    router = Router(settings.routing)
    metrics.registry.register(RoutingCollector(router, handles))
    metrics.registry.register(ModelCollector(models))
    tracing = tracing or start_tracing(settings.otlp_endpoint, "hetserve-router")
    dispatcher = Dispatcher(supervisor, settings, metrics, tracing, router, models)
    dispatcher.disagg = disaggregation(settings, devices, models.assignment(), metrics.registry)
    metrics.registry.register(ForeignCastCollector(handles))
    ctx = RouterContext(settings, supervisor, dispatcher,
                        metrics, WorkerStats(handles, settings.stats_interval_s, observers=[router.observe]),
                        CanaryMonitor(supervisor, settings), models)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await supervisor.start()
        background = [asyncio.create_task(_announce_when_settled(supervisor, on_settled, ctx.canary)),
                      asyncio.create_task(ctx.stats.run()), asyncio.create_task(run_canary(ctx.canary))]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await models.stop()
            logger.info("stopping %d workers", len(supervisor.workers))
            await supervisor.stop()
            tracing.shutdown()

    app = FastAPI(
        title="hetserve",
        version=VERSION,
        description="One worker per GPU, kernels and fp8 chosen per device. TGI-shaped `/generate`, "
        "OpenAI-compatible `/v1/*`, per-worker state at `/workers`. Route a request with the headers "
        "`X-Hetserve-Worker`, `X-Hetserve-Min-Capability`, `X-Hetserve-Fp8`.",
        lifespan=lifespan,
        **fastapi_telemetry_off(),
        docs_url=None,  # served by server/edge/routes/docs.py with local assets
        redoc_url=None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(DirectRoutes, fastapi=app)  # innermost: valid generation requests skip FastAPI's routing
    app.add_middleware(DisconnectGuard)  # inside the edge: runs for requests the edge let through
    app.add_middleware(EdgeMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       metrics=metrics)
    if tracing.enabled:  # outermost: the span covers the whole request, refusals included
        app.add_middleware(TracingMiddleware, tracing=tracing)
    for module in (generate, openai, responses, anthropic, tokenize, embedding_routes, model_routes, lora_routes,
                   workers, health, metrics_routes, status, docs):
        app.include_router(module.router)
    docs.mount_assets(app)
    return app


async def _announce_when_settled(supervisor: Supervisor, on_settled, canary: CanaryMonitor) -> None:
    await supervisor.wait_settled()
    await canary.first_round.wait()  # the workers serve once checked
    if on_settled is not None:
        on_settled(supervisor)
