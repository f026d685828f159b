"""`DirectRoutes` (server/edge/direct.py): a valid generation request reaches its endpoint without
FastAPI's routing, and every other request, refusals included, gets FastAPI's own answer."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from server.edge.direct import DirectRoutes
from server.edge.errors import install_error_handlers


class _Body(BaseModel):
    inputs: str = Field(min_length=1)
    n: int = 1


class _Refused(Exception):
    pass


def _app(direct: bool) -> tuple[FastAPI, list[bool]]:
    routed: list[bool] = []  # per request: whether FastAPI's router matched it (it sets `endpoint`)
    router = APIRouter()

    @router.post("/generate", response_model=None)
    async def generate(req: _Body, request: Request) -> Response:
        routed.append("endpoint" in request.scope)
        if req.inputs == "refuse":
            raise _Refused()
        return JSONResponse({"inputs": req.inputs, "n": req.n, "body": (await request.body()).decode()})

    @router.post("/v1/completions", response_model=None)
    async def other(req: _Body, request: Request):  # no Response annotation: FastAPI's to serve
        routed.append("endpoint" in request.scope)
        return {"inputs": req.inputs}

    app = FastAPI()
    install_error_handlers(app)

    @app.exception_handler(_Refused)
    async def _refused(request: Request, exc: _Refused):
        return JSONResponse({"refused": True}, status_code=409)

    if direct:
        app.add_middleware(DirectRoutes, fastapi=app)
    app.include_router(router)
    return app, routed


def _post(app: FastAPI, path: str, content: bytes, ctype: str | None = "application/json") -> httpx.Response:
    async def run():
        headers = {"content-type": ctype} if ctype else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, content=content, headers=headers)

    return asyncio.run(run())


def test_a_valid_request_skips_fastapis_routing_and_reads_the_same_body():
    """Guards the table lookup in `DirectRoutes.__call__` (`spec = self._table.get(...)`): without
    it every request went through FastAPI's routing."""
    app, routed = _app(direct=True)
    r = _post(app, "/generate", b'{"inputs": "hi", "n": 3}')
    assert r.status_code == 200 and r.json() == {"inputs": "hi", "n": 3, "body": '{"inputs": "hi", "n": 3}'}
    assert routed == [False]
    r = _post(app, "/v1/completions", b'{"inputs": "hi"}')  # an endpoint not of the direct form
    assert r.status_code == 200 and routed == [False, True]


def test_refusals_and_exceptions_answer_as_fastapi_does():
    """Every body the route's model refuses, and an endpoint's exception, get the answer the app
    without `DirectRoutes` gives, byte for byte."""
    cases = [(b'{"inputs": ""}', "application/json"), (b'{"inputs": "x", "n": "many"}', "application/json"),
             (b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b"", "application/json"),
             (b'{"inputs": "x"}', "text/plain"), (b'{"inputs": "x"}', None), (b'{"inputs": "refuse"}',
                                                                              "application/json"),
             (b'{"inputs": "ok"}', "application/json; charset=utf-8")]
    direct, _ = _app(direct=True)
    plain, _ = _app(direct=False)
    for content, ctype in cases:
        a, b = _post(direct, "/generate", content, ctype), _post(plain, "/generate", content, ctype)
        assert (a.status_code, a.content) == (b.status_code, b.content), (content, ctype, a.text, b.text)
    assert _post(direct, "/generate", b'{"inputs": "refuse"}').status_code == 409
