"""Adapter affinity in the router: a request naming a LoRA adapter goes to a worker that holds it,
else to one with a free slot, else to the least loaded one that can evict an idle adapter; each
tier within the bound on requests in flight (server/routing/lora_affinity.py, wired in
server/routing/router.py `Router.pick`)."""

from __future__ import annotations

from server.config.routing import CACHE_AWARE, RoutingConfig
from server.fleet.probe import Probe, ProbeVerdict
from server.routing.filter import Constraints
from server.routing.lora_affinity import EVICT, FREE_SLOT, HELD, OVERLOADED, AdapterSlots, adapter_pool
from server.routing.policy import LORA, Candidate
from server.routing.router import Router
from tests.test_routing_policy import _handles, _send


def _report(max_loras: int, **adapters: tuple[bool, int]) -> dict:
    """A worker's `/health` `loras`: name -> (loaded, requests)."""
    return {"max_loras": max_loras, "running": [], "waiting": [],
            "adapters": [{"name": n, "path": f"/a/{n}", "loaded": loaded, "requests": requests}
                         for n, (loaded, requests) in adapters.items()]}


def _cands(*outstanding: int) -> list[Candidate]:
    return [Candidate(f"gpu{i}", outstanding=n) for i, n in enumerate(outstanding)]


SLOTS = {
    "gpu0": AdapterSlots.from_report(_report(2, a=(True, 0), x=(True, 0)), {}),  # full, both idle
    "gpu1": AdapterSlots.from_report(_report(2, x=(False, 0)), {}),  # a free slot
    "gpu2": AdapterSlots.from_report(_report(2, y=(True, 1)), {"z": 1}),  # full, both in use
}


def test_slots_read_the_workers_report_and_the_requests_in_flight():
    assert SLOTS["gpu0"] == AdapterSlots(frozenset({"a", "x"}), 2, frozenset())
    assert not SLOTS["gpu0"].free and SLOTS["gpu0"].evictable
    assert SLOTS["gpu1"].free and SLOTS["gpu1"].held == frozenset()
    assert SLOTS["gpu2"] == AdapterSlots(frozenset({"y", "z"}), 2, frozenset({"y", "z"}))
    assert not SLOTS["gpu2"].free and not SLOTS["gpu2"].evictable
    unreported = AdapterSlots.from_report(None, {"a": 2})
    assert unreported.held == {"a"} and not unreported.free and not unreported.evictable


def test_the_holder_first_then_a_free_slot_then_the_least_loaded_that_can_evict():
    cands = _cands(0, 0, 0)
    held = adapter_pool(cands, "a", SLOTS, 1.5)
    assert (held.tier, [c.id for c in held.candidates]) == (HELD, ["gpu0"]) and "holds adapter a" in held.detail
    held = adapter_pool(cands, "z", SLOTS, 1.5)  # in flight there counts as held
    assert (held.tier, [c.id for c in held.candidates]) == (HELD, ["gpu2"])
    free = adapter_pool(cands, "b", SLOTS, 1.5)
    assert (free.tier, [c.id for c in free.candidates]) == (FREE_SLOT, ["gpu1"])
    no_free = {k: v for k, v in SLOTS.items() if k != "gpu1"}
    evict = adapter_pool(_cands(1, 0, 0), "b", no_free, 1.5)
    assert (evict.tier, [c.id for c in evict.candidates]) == (EVICT, ["gpu0"])  # gpu2's slots are all in use


def test_an_overloaded_holder_gives_way_to_a_free_slot():
    """Guards the bound in `adapter_pool`: a hot adapter's holder at the bound on requests in flight
    sends the next request to a worker with a free slot (a replica) instead of queueing."""
    pool = adapter_pool(_cands(9, 0, 0), "a", SLOTS, 1.5)
    assert (pool.tier, [c.id for c in pool.candidates]) == (FREE_SLOT, ["gpu1"])
    assert "its holders gpu0 are at the bound" in pool.detail


def test_nothing_known_leaves_every_worker_in_the_pool():
    pool = adapter_pool(_cands(0, 1), "a", {}, 1.5)
    assert pool.tier == OVERLOADED and [c.id for c in pool.candidates] == ["gpu0", "gpu1"]


def test_the_router_follows_the_adapter_and_says_why():
    """Guards the `adapter_pool` call in `Router.pick` and the in-flight count in `Router.begin`."""
    router, hs = Router(RoutingConfig(policy=CACHE_AWARE)), _handles(3)
    for h, report in zip(hs, (_report(2, a=(True, 0)), _report(2), _report(2, y=(True, 0), z=(True, 0))),
                         strict=True):
        h.probe = ProbeVerdict(Probe.OK, "ok", loras=report)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    first = _send(router, hs, body, Constraints(lora="a"))
    assert first.worker is hs[0] and first.route.reason == LORA and first.route.header == "lora:held"
    assert first.route.detail.startswith("holds adapter a; ")
    other = _send(router, hs, body, Constraints(lora="b"))
    assert other.worker is hs[0] or other.worker is hs[1]
    assert other.route.header == "lora:free-slot"
    # once `b` is in flight on a worker, the next `b` request follows it there
    again = _send(router, hs, body, Constraints(lora="b"))
    assert again.worker is other.worker and again.route.header == "lora:held"
    other.end()
    again.end()
    plain = _send(router, hs, body)  # no adapter: the policy alone
    assert plain.route.reason != LORA
