"""`GET /metrics`: Prometheus text, the router's series and every ready worker's, labelled, and the
Responses store's (how many responses it keeps and the bytes they hold)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from server.edge.context import get_ctx
from server.edge.routes.responses import response_store
from server.fleet.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    text = await get_ctx(request).metrics.render() + response_store(request).metrics()
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
