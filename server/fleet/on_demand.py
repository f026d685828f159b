"""Where a model loaded on demand goes, and what makes room for it: a pure function.

`plan_load` answers a request for a model that no worker serves: first the count (with
`--max-loaded-models N`, the least recently used models beyond N unload, never a protected
one), then the device (its pins, else the smallest free device that holds it, else a replica's
device, else what unloading the least recently used models frees). A model inside its minimum
residence (`--model-min-residence-s`) is not unloaded: when only such models stand in the way, the
answer is `Resident`, with the seconds until one may go, so that alternating requests for two
models cost one worker start per residence, not one per request. It gets that one device: the
devices left free stay free for the next load. A model that fits no device, or for which nothing
can be freed, is a `PlacementError` naming why (the caller answers 503). Trade-off: loading
never moves a loaded model, so a sequence of loads can leave a large device serving a small model
that a fresh `place` would have put elsewhere; moving models would stop workers that serve
requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from server.fleet.placement import (
    FIRST,
    PINNED,
    ModelAsk,
    ModelDoesNotFit,
    PlacementError,
    Slot,
    resolve_device,
)
from server.fleet.spec import worker_id
from workers.contract import DeviceInfo, human
from workers.contract.model_size import need_on, usable_bytes


class NoRoom(PlacementError):
    """Every device that could hold the model serves one that may not be unloaded now."""


class Resident(NoRoom):
    """Only models inside their minimum residence stand in the way; `retry_after`: seconds until one may go."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _resident(name: str, waiting: Sequence[str], resident: Mapping[str, float]) -> Resident:
    first = min(waiting, key=lambda m: resident[m])
    left = max(1, math.ceil(resident[first]))
    return Resident(f"Cannot load `{name}` now: it would unload `{first}`, which stays loaded for its minimum "
                    f"residence (--model-min-residence-s), {left} s more; retry after {left} s", left)


@dataclass(frozen=True)
class LoadPlan:
    """Start `start`; before that, stop the workers on `stop` (device indices), which unloads
    the models in `unload` entirely and leaves the others with their remaining devices."""

    model: str
    start: tuple[Slot, ...]
    stop: tuple[int, ...]
    unload: tuple[str, ...]
    reason: str


def plan_load(ask: ModelAsk, devices: Sequence[DeviceInfo], serving: Mapping[int, str], lru: Sequence[str],
              protected: Collection[str] = (), max_loaded: int | None = None,
              pinned_devices: Mapping[int, str] | None = None, dtype: str = "auto", quantize: str = "none",
              fraction: float | None = None, resident: Mapping[str, float] | None = None) -> LoadPlan:
    """Where `ask` goes and what unloads for it, in order:

    1. the count: with `max_loaded`, a new model beyond it unloads the least recently used models
       first (never a `protected` one: pinned with `--pin-model`, or loading now);
    2. the device: a model pinned with `--place` goes to its pins (the replica or model on each
       makes way); any other takes, among the devices that hold it, the smallest free one, else
       the smallest serving a replica (of the model with the most devices: it keeps the others;
       a device a model is pinned to is never taken from it), else unloads the least recently
       used models, one at a time, until one of their devices holds it.

    `serving`: device index -> the model its worker serves (or loads); `lru`: the loaded models,
    least recently used first; `pinned_devices`: device index -> the model `--place` pins there;
    `resident`: model -> seconds left of its minimum residence (never unloaded before; `Resident`)."""
    pinned_devices = pinned_devices or {}
    resident = {m: left for m, left in (resident or {}).items() if left > 0}
    serving = dict(serving)
    unload: list[str] = []
    stop: list[int] = []
    why: list[str] = []

    def evict(model: str, because: str) -> None:
        unload.append(model)
        for index, m in list(serving.items()):
            if m == model:
                stop.append(index)
                del serving[index]
        why.append(f"unloads {model} ({because})")

    def held_back() -> list[str]:  # not protected: may go, once any residence of theirs is over
        return [m for m in lru if m not in protected and m not in unload and m != ask.name]

    def evictable() -> list[str]:
        return [m for m in held_back() if m not in resident]

    # 1. the count of loaded models
    loaded = set(serving.values())
    while max_loaded is not None and len(loaded - set(unload)) + 1 > max_loaded:
        candidates = evictable()
        if not candidates and held_back():
            raise _resident(ask.name, held_back(), resident)
        if not candidates:
            raise NoRoom(f"Cannot load `{ask.name}`: {len(loaded)} models are loaded (--max-loaded-models "
                         f"{max_loaded}) and none may be unloaded now ({', '.join(sorted(loaded)) or 'none'} are "
                         "pinned or loading)")
        evict(candidates[0], f"least recently used; --max-loaded-models {max_loaded}")
    # 2. the device
    needs = {d.index: need_on(ask.profile, d, dtype, quantize) for d in devices}
    if ask.pins:
        targets = [resolve_device(t, devices) for t in ask.pins]
        for d in targets:
            assert d is not None  # pins were checked against the devices at startup
            holder = serving.get(d.index)
            if holder is not None:
                if holder in protected:
                    raise NoRoom(f"Cannot load `{ask.name}` on its pinned {worker_id(d)}: it serves `{holder}`, "
                                 "which may not be unloaded now")
                alone = sum(1 for m in serving.values() if m == holder) == 1
                if alone and holder in resident:
                    raise _resident(ask.name, [holder], resident)
                if not alone:
                    stop.append(d.index)
                    del serving[d.index]
                    why.append(f"takes {worker_id(d)} from a replica of {holder}")
                else:
                    evict(holder, f"it held {worker_id(d)}, pinned to {ask.name}")
        start = tuple(Slot(d, ask.name, PINNED, f"pinned by --place {ask.name}={','.join(ask.pins)}",
                           needs[d.index], usable_bytes(d, fraction)) for d in targets if d is not None)
        return LoadPlan(ask.name, start, tuple(stop), tuple(unload), "; ".join(why) or "its pinned devices are free")
    fitting = [d for d in devices if needs[d.index].total <= usable_bytes(d, fraction)]
    if not fitting:
        rooms = "; ".join(f"{worker_id(d)} {human(usable_bytes(d, fraction))} usable" for d in devices)
        raise ModelDoesNotFit(f"Model `{ask.name}` fits no device: it needs "
                              f"{max(needs.values(), key=lambda n: n.total).describe()}. Devices: {rooms}")
    order = {d.index: i for i, d in enumerate(devices)}

    def smallest(ds):
        return min(ds, key=lambda d: (usable_bytes(d, fraction), order[d.index]))

    chosen = None
    while chosen is None:
        free = [d for d in fitting if d.index not in serving]
        if free:
            chosen = smallest(free)
            break
        counts = Counter(serving.values())
        replicas = [d for d in fitting
                    if counts[serving[d.index]] > 1 and pinned_devices.get(d.index) != serving[d.index]]
        if replicas:
            most = max(counts[serving[d.index]] for d in replicas)
            chosen = smallest([d for d in replicas if counts[serving[d.index]] == most])
            why.append(f"takes {worker_id(chosen)} from a replica of {serving[chosen.index]}")
            stop.append(chosen.index)
            del serving[chosen.index]
            break
        holders = {serving[d.index] for d in fitting}
        candidates = [m for m in evictable() if m in holders]
        if not candidates and (waiting := [m for m in held_back() if m in holders]):
            raise _resident(ask.name, waiting, resident)
        if not candidates:
            held = ", ".join(f"{worker_id(d)} serves `{serving[d.index]}`" for d in fitting)
            raise NoRoom(f"Cannot load `{ask.name}` ({human(needs[fitting[0].index].total)}): every device that "
                         f"holds it serves a model that may not be unloaded now ({held})")
        evict(candidates[0], f"least recently used of those on a device that holds {ask.name}")
    slot = Slot(chosen, ask.name, FIRST, f"the smallest device that holds {ask.name}, free "
                + ("after " + "; ".join(why) if why else "already"), needs[chosen.index],
                usable_bytes(chosen, fraction))
    return LoadPlan(ask.name, (slot,), tuple(stop), tuple(unload), "; ".join(why) or f"{worker_id(chosen)} was free")
