"""The models: `GET /v1/models` (OpenAI's list, with where each model is placed) and, with the
API key, `POST /models/{name}/load` and `POST /models/{name}/unload`: without `--api-key` these
two answer 403 naming the flags (`--allow-unauthenticated-control` opens them), since starting
and stopping workers is the operator's, not any client's who reaches the port.

A model's entry: `id` (its name), `context_length` and `architecture` (what its worker reports
once loaded, else what its config.json says), `quantization` (`--quantize fp8`, or the
checkpoint's own method), `state` (loaded, loading, unloading, unloaded, failed) and
`placement`: per worker serving it, the device, the worker's state and why placement gave it
that device (with the bytes it needs there). `load` answers 200 once a
worker of the model is ready, 202 while it still starts after `ready_wait_s`, 503 with
`Retry-After` while the model it would unload is inside its minimum residence
(`--model-min-residence-s`); `unload` 200 once its workers have stopped (each finishes its
requests in flight), 409 for a `--pin-model` one; a model this router does not offer is a 404
naming those it does (server/fleet/models.py). A LoRA adapter (`--lora NAME=DIR`) is listed
after the models with `parent` (its base) and `root` (its directory), as vLLM lists them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.edge.context import RouterContext, get_ctx
from server.edge.errors import error_response
from server.fleet.models import ModelManager, ModelState
from workers.contract import HEADER_MODEL

router = APIRouter(tags=["models"])
_CONTROL_ERRORS = {401: {"description": "missing or wrong API key"},
                   403: {"description": "no API key set and --allow-unauthenticated-control not given"},
                   404: {"description": "no such model"}, 409: {"description": "a pinned model (unload)"},
                   503: {"description": "no room, or the model to unload is inside its minimum residence"}}


def model_entry(ctx: RouterContext, name: str) -> dict:
    """One model as `/v1/models` lists it."""
    view = ctx.model(name)
    info = view.reported()
    placed = [h for h in ctx.supervisor.workers.values() if h.model == name]
    described = ctx.models.describe(name) if ctx.models is not None else {"state": "loaded", "size": {}}
    size = described["size"]
    quantization = "fp8" if ctx.settings.quantize == "fp8" else size.get("quantization")
    return {
        "id": name, "object": "model", "created": int(ctx.started_at), "owned_by": "hetserve",
        "context_length": view.context_length(), "architecture": info.architecture or size.get("architecture"),
        "quantization": quantization, "state": described["state"],
        "placement": [{"worker_id": h.id, "state": h.state, "capability": h.spec.device.capability_str,
                       "device": h.spec.device.name, "reason": _reason(ctx, h.spec.device.index)} for h in placed],
    }


def _reason(ctx: RouterContext, index: int) -> str | None:
    """Why placement gave that device to this model, with the bytes (server/fleet/placement.py)."""
    placed = None if ctx.models is None else ctx.models.placed(index)
    return None if placed is None else placed["reason"]


CONTROL_REFUSED = ("Loading and unloading models needs an API key: start the server with `--api-key` (or "
                   "`--api-key-file`, `$HETSERVE_API_KEY`) and send it, or open these routes to every client with "
                   "`--allow-unauthenticated-control`")


def _refused(request: Request) -> JSONResponse | None:
    """403 for a control route of a server without an API key, unless the operator opened them."""
    settings = get_ctx(request).settings
    if settings.api_key is None and not settings.allow_unauthenticated_control:
        return error_response(request.url.path, 403, CONTROL_REFUSED, "forbidden")
    return None


def _manager(request: Request, name: str) -> ModelManager:
    """The model manager, once `name` is known to be one of its models (else 404)."""
    models = get_ctx(request).models
    assert models is not None
    models.require(name)
    return models


def model_list(ctx: RouterContext) -> dict:
    """`GET /v1/models`: every model offered, the default first, then each LoRA adapter with its
    base model as `parent` and its directory as `root` (vLLM's shape)."""
    models = [model_entry(ctx, name) for name in ctx.model_names()]
    base = ctx.model().name
    adapters = [{"id": name, "object": "model", "created": int(ctx.started_at), "owned_by": "hetserve",
                 "root": str(path), "parent": base} for name, path in ctx.loras.items()]
    return {"object": "list", "data": models + adapters}


@router.post("/models/{name}/load", responses=_CONTROL_ERRORS)
async def load(name: str, request: Request) -> JSONResponse:
    """Load `name` where placement puts it (making room as a request for it would)."""
    if (refused := _refused(request)) is not None:
        return refused
    models = _manager(request, name)
    model = await models.load(name, get_ctx(request).settings.ready_wait_s)
    code = 200 if model.state == ModelState.LOADED else 202
    return JSONResponse(models.describe(name), status_code=code, headers={HEADER_MODEL: name})


@router.post("/models/{name}/unload", responses=_CONTROL_ERRORS)
async def unload(name: str, request: Request) -> JSONResponse:
    """Stop every worker of `name`; its requests in flight finish first."""
    if (refused := _refused(request)) is not None:
        return refused
    models = _manager(request, name)
    await models.unload(name)
    return JSONResponse(models.describe(name), headers={HEADER_MODEL: name})
