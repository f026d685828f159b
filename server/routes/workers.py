"""`GET /workers` and `GET /workers/{id}`: each worker's state, device, fp8, kernels and load.

`{id}` is the worker id (`gpu1`); the device index (`1`) and the device UUID are accepted
too. States: starting, ready, unhealthy, restarting, failed (`reason` says why).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from server.context import get_ctx
from server.errors import shown

router = APIRouter(tags=["workers"])


@router.get("/workers")
async def list_workers(request: Request) -> dict:
    """Every worker, in device order."""
    ctx = get_ctx(request)
    max_batch = ctx.settings.max_batch
    return {"workers": [h.snapshot(max_batch) for h in ctx.supervisor.workers.values()]}


@router.get("/workers/{worker_id}")
async def get_worker(worker_id: str, request: Request) -> dict:
    """One worker by id, device index or device UUID."""
    ctx = get_ctx(request)
    for h in ctx.supervisor.workers.values():
        if h.answers_to(worker_id):
            return h.snapshot(ctx.settings.max_batch)
    known = ", ".join(ctx.supervisor.workers) or "none"
    raise HTTPException(404, f"No worker `{shown(worker_id)}`. Known: {known}")
