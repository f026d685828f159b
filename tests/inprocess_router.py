"""The router app in the test process (Starlette's TestClient) over stand-in worker processes.

For tests that must reach into the router (its tracer's in-memory exporter, its settings)
while its workers stay real processes speaking the socket contract:
`tests/router_fake_worker.py` (no model, no torch, ready in about a second).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.config.settings import RouterSettings
from server.edge.app import create_app
from tests.router_harness import FAKE_WORKER
from workers.contract import parse_simulate


@contextlib.contextmanager
def inprocess_router(simulate: str = "sm_80,sm_90", tracing=None, env: dict[str, str] | None = None,
                     **settings) -> Iterator[TestClient]:
    """A started app whose workers are all ready; `env` is set for the workers' environment."""
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        config = RouterSettings(worker_command=(sys.executable, str(FAKE_WORKER)), **settings)
        client = stack.enter_context(TestClient(create_app(config, parse_simulate(simulate), tracing=tracing)))
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        deadline = time.monotonic() + 60
        while client.get("/health").json().get("status") != "ok":
            assert time.monotonic() < deadline, client.get("/workers", headers=headers).text
            time.sleep(0.1)
        yield client
