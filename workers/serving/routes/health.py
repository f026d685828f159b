"""What the router probes: `GET /health`, `GET /capability`, `GET /metrics`. `/health` reports the
engine's liveness (pending work, age of its last step) beside the HTTP side's state, so the router
can tell a hung engine from an idle one, the KV cache's free blocks and the decode step's
compilation (which may go on after ready); it answers 503 unless ready. `/capability` is the
worker's fixed description plus what changes: its pid, its load and its free KV blocks. `/metrics`
is the worker's own Prometheus text (the router relabels it).
"""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from workers.contract import EngineLiveness, HealthPayload, Load
from workers.engine.metrics import CONTENT_TYPE
from workers.lora.metrics import describe_loras
from workers.serving.context import get_ctx

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    ctx = get_ctx(request)
    engine = ctx.engine
    running, queued = engine.load()
    ok = ctx.ready
    status = "ready" if ok else ("starting" if ctx.status == "starting" else "draining")
    live = engine.liveness()
    body = HealthPayload(status=status, worker_id=ctx.info.worker_id, load=Load(running=running, queued=queued),
                         engine=EngineLiveness(pending=live.pending, last_step_age_s=round(live.last_step_age_s, 3),
                                               steps=live.steps),
                         capacity=engine.kv_now(), compile=ctx.info.compile,
                         loras=describe_loras(engine.loras, engine.lora_load), speculative=engine.speculation(),
                         preparing=ctx.info.preparing or [], fallbacks=ctx.info.fallbacks or {})
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)


@router.get("/capability")
async def capability(request: Request):
    ctx = get_ctx(request)
    info, engine = ctx.info, ctx.engine
    running, queued = engine.load()
    now = info.model_copy(update={"pid": os.getpid(), "load": Load(running=running, queued=queued),
                                  "capacity": {**info.capacity, **engine.kv_now()},
                                  "speculative": engine.speculation()})
    absent = {name for name in ("deterministic", "pipeline", "speculative", "preparing", "fallbacks")
              if getattr(now, name) is None}
    return now.model_dump(mode="json", exclude=absent or None)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(get_ctx(request).engine.metrics.render(), media_type=CONTENT_TYPE)
