"""`GET /health`: 200 `ok` when every worker is ready, 200 `degraded` when some are, while any
worker's circuit breaker is not closed (`open_breakers` names them) or while the canary finds
any worker suspect (`canary_suspects`; a drained one is out of rotation, so not ready either),
503 when none is ready. `model` is the default model, `models` each model's state.

Open without the API key, so load balancers and orchestrators can probe it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.edge.context import RouterContext, get_ctx
from server.fleet.breaker import BreakerState
from workers.contract import WorkerState

router = APIRouter(tags=["health"])


def health_verdict(ctx: RouterContext) -> tuple[dict, int]:
    """`/health`'s body and status code (the status page shows the same verdict)."""
    # A worker stopping because its model unloads is no failure: it is not counted.
    handles = [h for h in ctx.supervisor.workers.values() if h.state != WorkerState.STOPPING]
    ready = [h.id for h in handles if h.routable]
    open_breakers = [h.id for h in handles if h.breaker.state != BreakerState.CLOSED]
    suspects = [h.id for h in handles if h.canary_suspect]
    if not ready:
        status, code = "unavailable", 503
    elif len(ready) == len(handles) and not open_breakers and not suspects:
        status, code = "ok", 200
    else:
        status, code = "degraded", 200
    body = {
        "status": status,
        "ready": len(ready),
        "total": len(handles),
        "workers": {h.id: h.state for h in handles},
        "open_breakers": open_breakers,
        "canary_suspects": suspects,
        "model": ctx.model_id(),
        "models": {name: ctx.models.state_of(name) for name in ctx.model_names()} if ctx.models else {},
    }
    return body, code


@router.get("/health", responses={503: {"description": "no worker is ready"}})
async def health(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    body, code = health_verdict(ctx)
    headers = {"retry-after": str(ctx.settings.retry_after_s)} if code == 503 else None
    return JSONResponse(body, status_code=code, headers=headers)
