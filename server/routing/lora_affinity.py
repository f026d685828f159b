"""Adapter affinity: which workers compete for a request that names a LoRA adapter (a pure function).

A worker serves an adapter from one of its `--max-loras` slots; reading one in costs a copy (or a
disk read) and may evict another adapter that later requests want back (the thrash SGLang's users
meet with more adapters than slots). So before the policy scores (server/routing/policy.py), the
candidates narrow to, in this order: the workers that hold the adapter (their `/health` says it is
loaded, or requests with it are in flight there); else, for an adapter no worker holds, those with
a free slot, else the least loaded worker that can evict an idle adapter for it. Each tier keeps
only workers within `bounded_load` of requests in flight. When every holder is past that bound,
the adapter gets another replica (a free slot first, else an idle adapter evicted; the worker reads
it on its first request) while it has fewer than `max_replicas` holders (`replica`); at the cap it
is replicated only when it is hot, its own requests in flight on each holder past the bound
(`hot`), and otherwise waits on its holders (`capped`), so one adapter never spreads over every
worker's slots because the fleet is busy with other work. `max_replicas` 0: no cap. Trade-off:
what a worker holds is known from its last probe plus the router's own requests in flight, so an
adapter evicted since the probe still counts as held (and as a replica) until the next one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.routing.policy import Candidate, bounded_load

HELD, FREE_SLOT, EVICT, OVERLOADED = "held", "free-slot", "evict", "overloaded"
REPLICA, HOT, CAPPED = "replica", "hot", "capped"


@dataclass(frozen=True)
class AdapterSlots:
    """What one worker holds: adapters loaded (or in use), the slots, and the adapters in use."""

    held: frozenset[str] = frozenset()
    max_loras: int | None = None  # None: not reported (a worker without a table, or not probed yet)
    busy: frozenset[str] = frozenset()  # adapters with requests running there: they cannot be evicted

    @property
    def free(self) -> bool:
        return self.max_loras is not None and len(self.held) < self.max_loras

    @property
    def evictable(self) -> bool:
        return self.max_loras is not None and len(self.busy) < self.max_loras

    @classmethod
    def from_report(cls, report: dict | None, inflight: Mapping[str, int]) -> AdapterSlots:
        """From a worker's `/health` `loras` (workers/lora/metrics.py `describe_loras`) and the
        requests this router has in flight there per adapter."""
        busy = frozenset(name for name, n in inflight.items() if n > 0)
        if not isinstance(report, dict):
            return cls(busy, None, busy)
        loaded = {a.get("name") for a in report.get("adapters", ()) if isinstance(a, dict) and a.get("loaded")}
        in_use = {a.get("name") for a in report.get("adapters", ()) if isinstance(a, dict) and a.get("requests")}
        max_loras = report.get("max_loras")
        return cls(frozenset(loaded | busy) - {None}, max_loras if isinstance(max_loras, int) else None,
                   frozenset(in_use | busy) - {None})


@dataclass(frozen=True)
class AdapterPool:
    """The candidates that compete for an adapter's request, and why (`tier`: HELD | FREE_SLOT |
    EVICT | OVERLOADED)."""

    candidates: tuple[Candidate, ...]
    tier: str
    detail: str


def adapter_pool(cands: Sequence[Candidate], lora: str, slots: Mapping[str, AdapterSlots], load_factor: float,
                 max_replicas: int = 0, inflight: Mapping[str, int] | None = None) -> AdapterPool:  # fmt: skip
    """The candidates for a request with adapter `lora` (see the module docstring); never empty.
    `inflight`: worker id -> this adapter's requests in flight there; `max_replicas` 0: no cap."""
    bound = bounded_load((c.outstanding for c in cands), load_factor)
    within = [c for c in cands if c.outstanding + 1 <= bound]
    none = AdapterSlots()
    holders = [c for c in cands if lora in slots.get(c.id, none).held]
    held_within = [c for c in holders if c in within]
    if held_within:
        return AdapterPool(tuple(held_within), HELD, f"holds adapter {lora}")
    tier, why = None, ""
    if holders:
        names = ", ".join(c.id for c in holders)
        own = min((inflight or {}).get(c.id, 0) for c in holders)
        if not max_replicas or len(holders) < max_replicas:
            cap = f"at most {max_replicas}" if max_replicas else "no cap"
            tier, why = REPLICA, (f"its holders {names} are at the bound of {bound} requests: replica "
                                  f"{len(holders) + 1} ({cap})")
        elif own + 1 > bound:
            tier, why = HOT, (f"hot: {own} or more of its requests in flight on each of its holders {names}, past "
                              f"the bound of {bound}: replica {len(holders) + 1} beyond the cap of {max_replicas}")
        else:
            return AdapterPool(tuple(holders), CAPPED,
                               f"adapter {lora} is on {len(holders)} workers, its cap (`--lora-max-replicas`), and "
                               f"not hot ({own} of its requests in flight on its least busy holder, bound {bound}): "
                               f"it waits on {names}")
    free = [c for c in within if slots.get(c.id, none).free]
    if free:
        detail = f"a free LoRA slot for adapter {lora}" + (f" ({why})" if why else "")
        return AdapterPool(tuple(free), tier or FREE_SLOT, detail)
    evict = [c for c in within if slots.get(c.id, none).evictable]
    if evict:
        best = min(evict, key=lambda c: (c.outstanding, c.picks, c.id))
        detail = f"least loaded; reads adapter {lora} in place of an idle one" + (f" ({why})" if why else "")
        return AdapterPool((best,), tier or EVICT, detail)
    return AdapterPool(tuple(holders or cands), OVERLOADED,
                       f"no worker within the bound of {bound} requests holds adapter {lora} or has a LoRA slot "
                       f"it can give it (every slot in use, or not reported yet)")
