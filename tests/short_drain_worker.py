"""A real worker whose drain after SIGTERM lasts at most `SHORT_DRAIN_S`, for the host KV tier's
end-to-end test (tests/test_e2e_kvtier.py): a stream then outlives the drain, the worker ends it
with its KV published to the tier, and the router moves it, in well under the default drain.

Started by the router in place of `python -m workers` (`HETSERVE_WORKER_CMD="python
tests/short_drain_worker.py"`); otherwise it is `workers.main.main`, as any worker. The hook lives
here, in the tests: nothing in `workers/` reads it."""

from __future__ import annotations

import sys

from workers.engine.core import Engine  # the router puts this checkout on the worker's PYTHONPATH
from workers.main import main

SHORT_DRAIN_S = 0.1


def shorten_drain() -> None:
    shutdown = Engine.shutdown

    def short(self, drain_timeout: float = 0.0) -> None:
        shutdown(self, min(drain_timeout, SHORT_DRAIN_S))

    Engine.shutdown = short


if __name__ == "__main__":
    shorten_drain()
    sys.exit(main())
