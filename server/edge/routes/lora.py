"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's shapes): LoRA adapters
added to and removed from the default model's workers at run time, with the API key.

A load checks the name and directory here, then asks every routable worker of the default model
to read it (`/lora/load`, workers/serving/routes/lora.py); if one refuses (an adapter of another
base, a rank above the limit), those that took it drop it again and the worker's named error is the
answer, so an adapter is served by all of the model's workers or by none. Success answers vLLM's
sentence as plain text. The supervisor remembers the adapters loaded (`runtime_loras`), and a
worker that restarts, or starts later, reads them at its start with the `--lora` ones, so
`/v1/models` (the router's list) and the workers agree across a restart. Trade-off: a worker
spawned while a load is under way (not yet ready, so not asked) misses that adapter until its next
start; without an API key the routes answer 403 as `/models/{name}/load` does.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictStr

from server.config.loras import ADAPTER_CONFIG
from server.config.models import ACCEPTED_NAMES, NAME_RE
from server.edge.context import RouterContext, get_ctx
from server.edge.errors import error_response
from server.edge.routes.models import _refused
from server.errors import shown
from server.fleet.handle import WorkerHandle
from workers.contract import LoraAdapterRequest

router = APIRouter(tags=["models"])
_ERRORS = {400: {"description": "a bad name or directory, or a name already served"},
           401: {"description": "missing or wrong API key"}, 403: {"description": "no API key set"},
           404: {"description": "no such adapter (unload)"}, 409: {"description": "requests still use it (unload)"},
           503: {"description": "no worker of the model is ready"}}


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr


def _workers(ctx: RouterContext) -> list[WorkerHandle]:
    base = ctx.model().name
    return [h for h in ctx.supervisor.workers.values() if h.model in (base, "") and h.routable]


async def _ask(h: WorkerHandle, path: str, body: LoraAdapterRequest) -> tuple[int, str]:
    status, _, content = await h.client.post(path, body)
    try:
        message = json.loads(content).get("error", "")
    except (ValueError, AttributeError):
        message = content.decode(errors="replace")
    return status, f"worker {h.id}: {message}"


@router.post("/v1/load_lora_adapter", response_model=None, responses=_ERRORS)
async def load_lora_adapter(req: LoadLoraAdapter, request: Request):
    """Serve the PEFT adapter in `lora_path` as model `lora_name` over the default model."""
    if (refused := _refused(request)) is not None:
        return refused
    ctx, url = get_ctx(request), request.url.path
    name = req.lora_name
    if not NAME_RE.match(name) or name in ctx.model_names():
        return error_response(url, 400, f"`lora_name` `{shown(name)}` is not accepted. Accepted: {ACCEPTED_NAMES}, "
                                        f"not a model's name", "validation")
    if name in ctx.loras:
        return error_response(url, 400, f"The LoRA adapter `{name}` has already been loaded", "validation")
    path = Path(req.lora_path).expanduser().resolve()
    if not (path / ADAPTER_CONFIG).is_file():
        return error_response(url, 400, f"`lora_path` `{shown(req.lora_path)}` holds no `{ADAPTER_CONFIG}`. "
                                        f"Accepted: a directory as PEFT's `save_pretrained` writes it", "validation")
    workers = _workers(ctx)
    if not workers:
        return error_response(url, 503, "No worker of the model is ready to load the adapter", "unavailable")
    body, done = LoraAdapterRequest(lora_name=name, lora_path=str(path)), []
    for h in workers:
        status, message = await _ask(h, "/lora/load", body)
        if status != 200:  # all or none: the workers that took it drop it again
            for other in done:
                await _ask(other, "/lora/unload", LoraAdapterRequest(lora_name=name))
            return error_response(url, status if status < 500 else 502, message, "validation")
        done.append(h)
    ctx.loras[name] = path
    ctx.supervisor.runtime_loras[name] = path  # a worker that restarts reads it again
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, responses=_ERRORS)
async def unload_lora_adapter(req: UnloadLoraAdapter, request: Request):
    """Stop serving adapter `lora_name`; refused (409) while requests use it."""
    if (refused := _refused(request)) is not None:
        return refused
    ctx, url, name = get_ctx(request), request.url.path, req.lora_name
    if name not in ctx.loras:
        return error_response(url, 404, f"The LoRA adapter `{shown(name)}` cannot be found. Served: "
                                        f"{', '.join(ctx.loras) or 'none'}", "model_not_found")
    for h in _workers(ctx):
        status, message = await _ask(h, "/lora/unload", LoraAdapterRequest(lora_name=name))
        if status not in (200, 404):
            return error_response(url, status, message, "conflict" if status == 409 else None)
    del ctx.loras[name]
    ctx.supervisor.runtime_loras.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

