"""A real worker whose event loop is busy when probed, for tests/test_busy_not_hung.py.

Started by the router in place of `python -m workers` (`HETSERVE_WORKER_CMD="python
tests/busy_worker.py"`): its first `$BUSY_PROBES` answers to `/health` after ready each compute on
the event loop for `$BUSY_SECONDS` first (a loaded host, a first compile holding the interpreter),
so the router's probe times out while the process computes and its engine thread completes steps.
Then it is `workers.main.main`, as any worker. The hook lives here, in the tests: nothing in
`workers/` reads it.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from fastapi import Request

from workers.main import main  # the router puts this checkout on the worker's PYTHONPATH
from workers.serving.routes import health as health_routes

logger = logging.getLogger("tests.busy_worker")


def busy_health(probes: int, seconds: float) -> None:
    """The `/health` route computes for `seconds` on the event loop before its first `probes` ready answers."""
    route = next(r for r in health_routes.router.routes if getattr(r, "path", None) == "/health")
    answer = route.endpoint  # the app includes this router's routes from their endpoints when it is built
    left = [probes]

    async def slow_health(request: Request):
        if left[0] > 0 and request.app.state.ctx.ready:
            left[0] -= 1
            end = time.process_time() + seconds
            while time.process_time() < end:  # CPU on the event loop, as a compile holding the GIL
                pass
        return await answer(request)

    route.endpoint = slow_health
    logger.warning("TEST-ONLY: the first %d ready /health answers compute %g s first", probes, seconds)


if __name__ == "__main__":
    busy_health(int(os.environ.get("BUSY_PROBES", "3")), float(os.environ.get("BUSY_SECONDS", "2")))
    sys.exit(main())
