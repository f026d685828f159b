"""`GET /workers` and `GET /workers/{id}`: each worker's state, device, fp8, kernels and load.

`{id}` is the worker id (`gpu1`); the device index (`1`) and the device UUID are accepted too.
Each entry is what the worker reported about itself (`WorkerHandle.snapshot`) plus `placement`
(why its device serves its model) and `routing` (measured speed, tokens in flight, prefix chunks,
decisions by reason); `/workers` also lists every model's state and every device's placement,
free ones too (the fields: docs/serving.md). Design: one read of the router's own state, no call
to a worker, so it answers at once even while a worker hangs; the trade-off is that what it
shows is as fresh as the last probe and `/metrics` sample.
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
    disagg = ctx.dispatcher.disagg  # its disaggregation role: prefill, decode or both (server/routing/roles.py)
    if disagg is not None:  # under `auto`, the roles the measured speeds give now
        disagg.refresh(router, ctx.supervisor.workers.values())
    role = {"role": "both", "reason": None} if disagg is None else disagg.describe(h.id)
    return {**h.snapshot(ctx.settings.max_batch), "placement": placed, "routing": routing, "disaggregation": role}


def model_entries(ctx: RouterContext) -> list[dict]:
    """`models`: each model's state, its workers, its loads and unloads, its size (server/fleet/models.py);
    loading on demand shows there as it happens."""
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
