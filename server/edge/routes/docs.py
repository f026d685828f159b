"""`GET /docs`: Swagger UI for the OpenAPI schema, its script and stylesheet served from here.

FastAPI's default page loads Swagger UI from a public CDN, which a server without internet
access (or a browser behind a strict proxy) cannot reach. The assets come from the
`swagger-ui-bundle-v2` package instead, under `/docs/assets/`; the page needs nothing from
outside. ReDoc (also CDN-only) is not served.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"
router = APIRouter(include_in_schema=False)


@router.get("/docs")
async def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="hetserve API",
        swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
    )


def mount_assets(app: FastAPI) -> None:
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")
