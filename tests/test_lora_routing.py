"""Adapter affinity in the router: a request naming a LoRA adapter goes to a worker that holds it,
else to one with a free slot, else to the least loaded one that can evict an idle adapter; each
tier within the bound on requests in flight (server/routing/lora_affinity.py, wired in
server/routing/router.py `Router.pick`)."""

from __future__ import annotations

from server.config.routing import CACHE_AWARE, RoutingConfig
from server.fleet.probe import Probe, ProbeVerdict
from server.routing.filter import Constraints
from server.routing.lora_affinity import (
    CAPPED,
    EVICT,
    FREE_SLOT,
    HELD,
    HOT,
    OVERLOADED,
    REPLICA,
    AdapterSlots,
    adapter_pool,
)
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
    assert (pool.tier, [c.id for c in pool.candidates]) == (REPLICA, ["gpu1"])
    assert "its holders gpu0 are at the bound" in pool.detail and "replica 2 (no cap)" in pool.detail


# four workers, adapter `a` on gpu0 and gpu1 (the cap of 2), gpu2 with a free slot, gpu3 full but idle
CAP = {"gpu0": AdapterSlots.from_report(_report(2, a=(True, 0)), {}),
       "gpu1": AdapterSlots.from_report(_report(2, a=(True, 0)), {}),
       "gpu2": AdapterSlots.from_report(_report(2), {}),
       "gpu3": AdapterSlots.from_report(_report(1, x=(True, 0)), {})}


def test_an_adapter_at_its_cap_waits_on_its_holders_unless_it_is_hot():
    """Guards the cap in `adapter_pool`: with its two holders past the bound (busy with other
    adapters' requests), `a` waits there rather than taking a third worker's slot; once its own
    requests fill its holders past the bound it is hot, and gets a third replica."""
    busy = _cands(6, 6, 0, 0)
    capped = adapter_pool(busy, "a", CAP, 1.5, max_replicas=2, inflight={"gpu0": 1, "gpu1": 2})
    assert (capped.tier, [c.id for c in capped.candidates]) == (CAPPED, ["gpu0", "gpu1"])
    assert "its cap (`--lora-max-replicas`), and not hot (1 of its requests" in capped.detail
    assert "bound 6" in capped.detail  # 1.5 x the mean with this request, rounded up, plus one
    hot = adapter_pool(busy, "a", CAP, 1.5, max_replicas=2, inflight={"gpu0": 6, "gpu1": 6})
    assert (hot.tier, [c.id for c in hot.candidates]) == (HOT, ["gpu2"])
    assert "hot: 6 or more of its requests in flight on each of its holders gpu0, gpu1" in hot.detail
    assert "replica 3 beyond the cap of 2" in hot.detail
    full = {k: v for k, v in CAP.items() if k != "gpu2"}
    hot_evict = adapter_pool(busy, "a", full, 1.5, max_replicas=2, inflight={"gpu0": 6, "gpu1": 6})
    assert (hot_evict.tier, [c.id for c in hot_evict.candidates]) == (HOT, ["gpu3"])
    under = adapter_pool(busy, "a", CAP, 1.5, max_replicas=3, inflight={"gpu0": 1, "gpu1": 1})
    assert (under.tier, [c.id for c in under.candidates]) == (REPLICA, ["gpu2"])
    assert "replica 3 (at most 3)" in under.detail
    uncapped = adapter_pool(busy, "a", CAP, 1.5, max_replicas=0, inflight={"gpu0": 1, "gpu1": 1})
    assert uncapped.tier == REPLICA


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


def test_the_router_caps_an_adapters_replicas_and_says_so():
    """Guards the `lora_max_replicas` and in-flight arguments of the `adapter_pool` call in
    `Router.pick`: `a` held on gpu0 (the cap of 1), which other work keeps busy, waits there
    (`lora:capped`); its own requests filling gpu0 make it hot and the next goes to gpu1 (`lora:hot`)."""
    router, hs = Router(RoutingConfig(policy=CACHE_AWARE, lora_max_replicas=1, load_factor=1.0)), _handles(2)
    for h, report in zip(hs, (_report(2, a=(True, 0)), _report(2)), strict=True):
        h.probe = ProbeVerdict(Probe.OK, "ok", loras=report)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 4}}
    others = [_send(router, hs, body, Constraints(worker=hs[0].id)) for _ in range(3)]  # not `a`'s work
    capped = _send(router, hs, body, Constraints(lora="a"))
    assert capped.worker is hs[0] and capped.route.header == "lora:capped", capped.route
    for t in (*others, capped):
        t.end()
    mine = [_send(router, hs, body, Constraints(lora="a")) for _ in range(3)]
    assert all(t.worker is hs[0] for t in mine)
    hot = _send(router, hs, body, Constraints(lora="a"))
    assert hot.worker is hs[1] and hot.route.header == "lora:hot", hot.route
    assert "beyond the cap of 1" in hot.route.detail
