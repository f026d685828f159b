"""`POST /lora/load` and `POST /lora/unload`: adapters added to and removed from this worker's
table at run time (the router's `/v1/load_lora_adapter`, vLLM's shapes).

A load reads and checks the adapter off the event loop and, the first time, hooks the model's
projections between two engine steps (`Engine.steps_held`); a bad adapter is the table's named
error as a 422, a name already served a 409 as is an unload of one that requests still use, an
unknown name a 404.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from workers.contract import LoraAdapterRequest
from workers.engine.openmp import pool_released
from workers.lora.adapter import LoraError
from workers.lora.table import LoraInUse, UnknownLora
from workers.serving.context import get_ctx
from workers.serving.errors import APIError

router = APIRouter()


def _table(request: Request):
    table = get_ctx(request).engine.loras
    if table is None:
        raise APIError(404, "This worker serves no LoRA adapters (a pipeline stage)", "model_not_found")
    return table


@router.post("/lora/load")
async def load(req: LoraAdapterRequest, request: Request) -> dict:
    table, engine = _table(request), get_ctx(request).engine
    if req.lora_path is None:
        raise APIError(422, "`lora_path` is required to load an adapter: its PEFT directory", "validation")
    if req.lora_name in table:
        raise APIError(409, f"LoRA adapter `{req.lora_name}` is already loaded. Accepted: a new name, or unload "
                            f"it first", "conflict")

    def register():
        # hooks go on between steps, never under a running forward; this thread's OpenMP pool given back
        with engine.steps_held(), pool_released():
            return table.register(req.lora_name, req.lora_path)

    try:
        adapter = await asyncio.to_thread(register)
    except LoraError as e:
        raise APIError(422, str(e), "validation") from e
    return {"lora_name": adapter.name, "rank": adapter.rank, "scale": adapter.scale}


@router.post("/lora/unload")
async def unload(req: LoraAdapterRequest, request: Request) -> dict:
    try:
        _table(request).unregister(req.lora_name)
    except UnknownLora as e:
        raise APIError(404, str(e), "model_not_found") from e
    except LoraInUse as e:
        raise APIError(409, str(e), "conflict") from e
    return {"lora_name": req.lora_name}
