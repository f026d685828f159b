"""The status page (`GET /` for a browser, `GET /status`) and its live data (`GET /stats`).

The page is one self-contained file (`server/edge/static/status.html`: inline style and script,
no font, CDN or framework), so it works on an air-gapped host, and its shell holds no data: it
is served without the API key, then fetches `/workers` (every second) and `/stats` (every two
seconds) with the key as a Bearer token, asking for it once and keeping it in the browser's
session storage; a Content-Security-Policy allows exactly the page's own inline style and script
(by hash) and requests to this origin. `GET /` answers the page to a client that accepts HTML
(browsers, `curl`'s `*/*`) and 406 otherwise; TGI's `POST /` is unchanged. `/stats` is the
page's JSON: `/health`'s verdict, every model's state, and per worker the recent tokens/s, KV
cache usage and load (`WorkerStats`). Trade-off: the page polls rather than being pushed to,
so it is a second or two behind, and it needs no connection held open per viewer.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from server.edge.context import VERSION, get_ctx
from server.edge.errors import error_response
from server.edge.routes.health import health_verdict
from server.edge.routes.workers import model_entries

router = APIRouter(tags=["status"])

PAGE_PATH = Path(__file__).resolve().parent.parent / "static" / "status.html"


def _csp(page: str) -> str:
    """A policy that allows only the page's own inline style and script, and same-origin fetches."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


PAGE = PAGE_PATH.read_text(encoding="utf-8")
PAGE_HEADERS = {
    "content-security-policy": _csp(PAGE),
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def accepts_html(accept: str | None) -> bool:
    """Does an `Accept` header admit HTML? (absent, `*/*`, `text/*` or `text/html`, q > 0)"""
    if not accept:
        return True
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = next((p[2:] for p in params if p.startswith("q=")), "1")
        if media.lower() in ("text/html", "text/*", "*/*") and q not in ("0", "0.0", "0.00", "0.000"):
            return True
    return False


def page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=PAGE_HEADERS)


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    """The status page for a browser; `POST /` generates (TGI)."""
    if accepts_html(request.headers.get("accept")):
        return page()
    return error_response("/", 406, "`GET /` serves the status page as HTML (send `Accept: text/html`). "
                          "JSON: `GET /workers`, `GET /stats`, `GET /health`; generation: `POST /`", "not_acceptable")


@router.get("/status", include_in_schema=False)
async def status() -> HTMLResponse:
    """The status page."""
    return page()


@router.get("/stats")
async def stats(request: Request) -> dict:
    """The status page's live data: `/health`'s verdict, the model and each worker's recent activity."""
    ctx = get_ctx(request)
    health, _ = health_verdict(ctx)
    sampler = ctx.stats
    return {
        "version": VERSION,
        "model": ctx.model_id(),
        "models": model_entries(ctx),
        "health": health,
        "uptime_s": round(time.time() - ctx.started_at, 1),
        "interval_s": sampler.interval_s if sampler else None,
        "window_s": sampler.window_s if sampler else None,
        "workers": sampler.snapshot() if sampler else {},
    }
