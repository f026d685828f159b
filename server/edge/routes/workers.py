"""`GET /workers` and `GET /workers/{id}`: each worker's state, device, fp8, kernels and load.

Each entry ends with `routing`: the worker's measured speed (prefill and decode tokens per
engine-second; null where not measured yet), the tokens the router has in flight there, the prompt prefix chunks it
remembers for it and its routing decisions by reason (server/routing/).
`{id}` is the worker id (`gpu1`); the device index (`1`) and the device UUID are accepted
too. States: starting, ready, unhealthy, restarting, failed, stopping (its model unloads;
`reason` says why). Each worker's `model.name` is the model it serves; `/workers` also lists
`models`: each one's state (loaded, loading, unloading, unloaded, failed), workers, loads and
unloads, so loading on demand shows there as it happens. Each worker's `placement` says why its
device serves its model (`role`: pinned, first, replica; `reason` with the bytes it needs there
of those usable); the top-level `placement` lists every device, the free ones with why they are
free (no model fits, left for loading on demand, freed by an unload).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from server.edge.context import RouterContext, get_ctx
from server.errors import shown
from server.fleet.handle import WorkerHandle
from server.routing.metrics import speed_view

router = APIRouter(tags=["workers"])


def _entry(ctx: RouterContext, h: WorkerHandle) -> dict:
    """The worker's own entry plus `placement` (why its device serves its model, the bytes) and
    `routing`: its measured speed, load in tokens, prefix chunks, decisions."""
    placed = None if ctx.models is None else ctx.models.placed(h.spec.device.index)
    router = ctx.dispatcher.router
    routing = {**router.snapshot(h), "speed": speed_view(router.telemetry.speed(h.id))}  # unmeasured: None
    return {**h.snapshot(ctx.settings.max_batch), "placement": placed, "routing": routing}


def model_entries(ctx: RouterContext) -> list[dict]:
    """`models`: each model's state, its workers, its loads and unloads, its size (server/fleet/models.py)."""
    return [] if ctx.models is None else [ctx.models.describe(name) for name in ctx.model_names()]


@router.get("/workers")
async def list_workers(request: Request) -> dict:
    """Every worker, in device order, every model with where it is loaded, and every device's
    placement (free ones too, each with its reason)."""
    ctx = get_ctx(request)
    return {"workers": [_entry(ctx, h) for h in ctx.supervisor.workers.values()], "models": model_entries(ctx),
            "placement": [] if ctx.models is None else ctx.models.placements()}


@router.get("/workers/{worker_id}")
async def get_worker(worker_id: str, request: Request) -> dict:
    """One worker by id, device index or device UUID."""
    ctx = get_ctx(request)
    for h in ctx.supervisor.workers.values():
        if h.answers_to(worker_id):
            return _entry(ctx, h)
    known = ", ".join(ctx.supervisor.workers) or "none"
    raise HTTPException(404, f"No worker `{shown(worker_id)}`. Known: {known}")
