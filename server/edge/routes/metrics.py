"""`GET /metrics`: Prometheus text, the router's series and every ready worker's, labelled."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from server.edge.context import get_ctx
from server.fleet.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    text = await get_ctx(request).metrics.render()
    return PlainTextResponse(text, media_type=CONTENT_TYPE)
