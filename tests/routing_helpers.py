"""The dispatcher's two routing stages composed for unit tests: the filter, then the router's pick.

`choose` does what `Dispatcher._acquire` does before it dispatches: `eligible` says which
workers may take the request (or why none may), then a `Router` scores and picks among them
(least-loaded unless the test passes its own router and request). Nothing is dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config.routing import LEAST_LOADED, RoutingConfig
from server.fleet.handle import WorkerHandle
from server.routing.filter import ELIGIBLE, Constraints, eligible
from server.routing.policy import Route
from server.routing.router import Router, RouteRequest
from workers.contract import WorkerRequest

PICK = "pick"


@dataclass(frozen=True)
class Decision:
    kind: str  # PICK, or the filter's refusal
    reason: str
    worker: WorkerHandle | None = None
    route: Route | None = None


def choose(workers, c: Constraints, capacity: int, exclude: dict[str, int] | None = None,
           router: Router | None = None, req: RouteRequest | None = None) -> Decision:
    f = eligible(workers, c, capacity, exclude)
    if f.kind != ELIGIBLE:
        return Decision(f.kind, f.reason)
    router = router or Router(RoutingConfig(policy=LEAST_LOADED))
    req = req or router.request(WorkerRequest(), c)
    worker, route = router.pick(list(f.workers), c, req)
    return Decision(PICK, f"{route.header}: {route.detail} ({f.reason})", worker, route)
