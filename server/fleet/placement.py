"""Which model each device serves: a pure function of (models, devices, pins), with a reason per device.

One worker per GPU serves one model. `place` decides pins first, then every other model, the
largest need first, on the smallest free device that holds it (best fit: the larger devices stay
for the larger models), then replicas on the devices left; a model's need on a device is
`workers.contract.model_size.need_on` (its weights as that device loads them plus the KV cache
of one sequence) against the device's `usable_bytes`. Loading a model later, on demand, is the
same rule over the devices free then (server/fleet/on_demand.py); the rule in full:
docs/placement.md. Trade-off: best fit, largest first, is a greedy rule, not a search: it can
refuse a set of models that some other assignment would fit, and then says which device holds
what so the user can pin them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from server.errors import UsageError, shown
from server.fleet.pipelines import PipelineError, PipelineGroup, auto_device_sets, auto_devices, plan_pipeline
from server.fleet.spec import worker_id
from workers.contract import DeviceInfo, human
from workers.contract.model_size import ModelProfile, ModelSizeError, Need, need_on, usable_bytes
from workers.contract.stage_timing import PipelineTiming, read_timings, timings_path

PINNED, FIRST, REPLICA, FREE, STAGE = "pinned", "first", "replica", "free", "stage"


class PlacementError(UsageError):
    """No placement satisfies the models, devices and pins; the message gives the figures."""


class PinError(PlacementError):
    """A `--place` pin that names no device, names one twice, conflicts, or does not fit."""


class ModelDoesNotFit(PlacementError):
    """A model larger than every device."""


class NoDeviceLeft(PlacementError):
    """A model that fits some device, but every such device already serves another model."""

    def __init__(self, message: str, model: str, holders: tuple[str, ...]):
        super().__init__(message)
        self.model, self.holders = model, holders


@dataclass(frozen=True)
class ModelAsk:
    """One model to place: its name, its sizes and the devices it is pinned to (`--place`)."""

    name: str
    profile: ModelProfile
    pins: tuple[str, ...] = ()


@dataclass(frozen=True)
class Slot:
    """One device's verdict: the model it serves (None: free), why, and the figures."""

    device: DeviceInfo
    model: str | None
    role: str  # PINNED | FIRST | REPLICA | FREE
    reason: str
    need: Need | None  # its model's need on this device
    usable: int

    @property
    def worker_id(self) -> str:
        return worker_id(self.device)

    def to_dict(self) -> dict:
        return {"worker_id": self.worker_id, "device": self.device.to_dict(), "model": self.model, "role": self.role,
                "reason": self.reason, "usable_bytes": self.usable,
                "need": None if self.need is None else self.need.to_dict()}


@dataclass(frozen=True)
class Placement:
    slots: tuple[Slot, ...]  # in device order
    models: tuple[str, ...] = field(default=())  # every model placed, in the order given
    pipelines: tuple[PipelineGroup, ...] = ()  # replicas over several devices (server/fleet/pipelines.py)

    def devices_of(self, model: str) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.model == model)

    def to_dict(self) -> dict:
        out = {"devices": [s.to_dict() for s in self.slots],
               "models": {m: [s.worker_id for s in self.devices_of(m)] for m in self.models}}
        if self.pipelines:
            out["pipelines"] = [g.to_dict() for g in self.pipelines]
        return out


@dataclass(frozen=True)
class Split:
    """How pipelines are formed: `--pipeline N` (`stages`; None: auto), `--pipeline-partition`, and
    `$HETSERVE_SLOWDOWN` (server/fleet/pipelines.py weighs each device's speed by it)."""

    stages: int | None = None
    partition: tuple[int, ...] | None = None
    slowdown: str = ""
    timings: Mapping[str, PipelineTiming] = field(default_factory=dict)  # what earlier replicas measured


def split_of(settings) -> Split:
    """The pipeline flags of a run (`--pipeline`, `--pipeline-partition`), its `$HETSERVE_SLOWDOWN`
    and the stage timings recorded on this host (`$HETSERVE_STAGE_TIMINGS`)."""
    import os

    from workers.contract.slowdown import ENV_SLOWDOWN

    return Split(settings.models.pipeline, settings.models.partition, os.environ.get(ENV_SLOWDOWN, ""),
                 read_timings(timings_path()))


def resolve_device(token: str, devices: Sequence[DeviceInfo]) -> DeviceInfo | None:
    """The device a pin names: its worker id (`gpu0`), index (`0`) or UUID (any case)."""
    t = token.strip().lower()
    for d in devices:
        if t in (worker_id(d), str(d.index), d.uuid.lower()):
            return d
    return None


def _room(d: DeviceInfo, fraction: float | None = None) -> str:
    return (f"{worker_id(d)} ({d.capability_label}): {human(usable_bytes(d, fraction))} usable of "
            f"{human(d.memory_total_bytes)}")


def _pin_devices(m: ModelAsk, token: str, devices: Sequence[DeviceInfo], taken: dict) -> list[DeviceInfo]:
    """The devices one pin names (`gpu0`, or `gpu0+gpu2` for one pipeline replica), checked."""
    out = []
    for part in token.split("+"):
        d = resolve_device(part, devices)
        if d is None:
            known = ", ".join(f"{worker_id(x)} (index {x.index}, {x.uuid})" for x in devices) or "none"
            raise PinError(f"`--place {m.name}={','.join(m.pins)}`: no device `{shown(part)}`. Known: {known}")
        if d.index in taken or d in out:
            if d.index in taken and taken[d.index][0] != m.name:
                raise PinError(f"Device {worker_id(d)} is pinned to both `{taken[d.index][0]}` and `{m.name}`: one "
                               "worker per GPU serves one model. Pin each device to one model")
            raise PinError(f"`--place {m.name}={','.join(m.pins)}` names {worker_id(d)} twice")
        out.append(d)
    return out


def _pins(models: Sequence[ModelAsk], devices: Sequence[DeviceInfo], fits, needs, fraction: float | None = None,
          dtype: str = "auto", quantize: str = "none", split: Split = Split()):
    """(device index -> (model, PINNED | STAGE, reason) for every pin, the pinned pipelines);
    `PinError` for a bad pin."""
    owner: dict[int, tuple[str, str, str]] = {}
    groups: list[PipelineGroup] = []
    for m in models:
        for token in m.pins:
            devs = _pin_devices(m, token, devices, owner)
            why = f"pinned by --place {m.name}={','.join(m.pins)}"
            if len(devs) > 1:  # one replica over several devices
                group = plan_pipeline(m.name, m.profile, devs, dtype, quantize, fraction, split.partition,
                                      split.slowdown, why, split.timings)
                groups.append(group)
                for i, d in enumerate(devs):
                    owner[d.index] = (m.name, PINNED if i == 0 else STAGE, f"{why}: pipeline stage {i}, "
                                                                            f"{group.splits[i].reason}")
                continue
            d = devs[0]
            if not fits(m, d):
                raise PinError(f"`--place {m.name}={','.join(m.pins)}`: `{m.name}` needs "
                               f"{needs[m.name, d.index].describe()} on {_room(d, fraction)}")
            owner[d.index] = (m.name, PINNED, why)
    return owner, groups


def check_pins(models: Sequence[ModelAsk], devices: Sequence[DeviceInfo], dtype: str = "auto",
               quantize: str = "none", fraction: float | None = None) -> None:
    """`PinError` if any model's pins name no device, repeat, conflict or cannot hold it (the
    check `place` makes, for models not placed yet: loaded on demand later)."""
    needs = {(m.name, d.index): need_on(m.profile, d, dtype, quantize) for m in models for d in devices}
    _pins(models, devices, lambda m, d: needs[m.name, d.index].total <= usable_bytes(d, fraction), needs, fraction,
          dtype, quantize)


def place(models: Sequence[ModelAsk], devices: Sequence[DeviceInfo], dtype: str = "auto", quantize: str = "none",
          *, replicas: bool = True, fraction: float | None = None, split: Split = Split()) -> Placement:
    """Which model each device serves, in this order:

    1. pins (`--place chat=gpu0,gpu2`: a worker id, a device index or a UUID): those devices serve
       that model and no other; a device pinned twice, pinned twice to one model, unknown, or too
       small for the model pinned to it is a `PinError` with the figures;
    2. every other model, the largest need first, gets the smallest free device that holds it; a
       model that fits no device is a `ModelDoesNotFit` with its need and every device's room, one
       whose fitting devices are all taken a `NoDeviceLeft` naming who holds them;
    3. with `replicas`, each device left (largest first) serves another replica of the model that
       fits it with the fewest devices so far (ties: the larger need, then the order given);
       pinned models get exactly their pins.
    """
    needs = {(m.name, d.index): need_on(m.profile, d, dtype, quantize) for m in models for d in devices}
    usable = {d.index: usable_bytes(d, fraction) for d in devices}  # fraction: --gpu-memory-utilization
    order = {d.index: i for i, d in enumerate(devices)}
    owner: dict[int, tuple[str, str, str]] = {}  # device index -> (model, role, reason)

    def fits(m: ModelAsk, d: DeviceInfo) -> bool:
        return needs[m.name, d.index].total <= usable[d.index]

    # 1. pins
    pinned, groups = _pins(models, devices, fits, needs, fraction, dtype, quantize, split)
    owner.update(pinned)
    pinned_models = {m.name for m in models if m.pins}

    def pipeline(m: ModelAsk, devs: list[DeviceInfo], why: str) -> None:
        group = plan_pipeline(m.name, m.profile, devs, dtype, quantize, fraction, split.partition, split.slowdown,
                              why, split.timings)
        groups.append(group)
        pinned_models.add(m.name)  # its replica is the pipeline: no single-device replicas beside it
        for i, d in enumerate(devs):
            owner[d.index] = (m.name, FIRST if i == 0 else STAGE, f"pipeline stage {i}: {group.splits[i].reason}")

    # 2. each model still without a device: the largest need first, the smallest device that holds it
    placed = {o[0] for o in owner.values()}
    todo = sorted((m for m in models if m.name not in placed),
                  key=lambda m: -max((needs[m.name, d.index].total for d in devices), default=0))
    for m in todo:
        free_now = [d for d in devices if d.index not in owner]
        if split.stages is not None and split.stages > 1:  # --pipeline N
            devs = auto_devices(m.profile, free_now, dtype, quantize, fraction, split.stages)
            if devs is None:
                raise NoDeviceLeft(f"`--pipeline {split.stages}`: `{m.name}` needs {split.stages} free devices; "
                                   f"{len(free_now)} are free", m.name, ())
            pipeline(m, devs, f"--pipeline {split.stages}")
            continue
        fitting = [d for d in devices if fits(m, d)]
        split_why = ""
        if not fitting and split.stages is None:  # --pipeline auto: split what no single device holds
            tried: list[str] = []
            split_done = False
            for devs in auto_device_sets(m.profile, free_now, dtype, quantize, fraction):
                why = f"fits no single device (needs {human(needs[m.name, devices[0].index].total)})"
                try:
                    pipeline(m, devs, why + (f"; tried first {'; '.join(tried)}" if tried else ""))
                    split_done = True
                    break
                except (PipelineError, ModelSizeError) as e:  # the split needs more: one more device
                    tried.append(f"{len(devs)} devices: {e}")
            if split_done:
                continue
            split_why = f" (tried {'; '.join(tried)})" if tried else ""
        if not fitting:
            rooms = "; ".join(f"{_room(d, fraction)}, needs {human(needs[m.name, d.index].total)}"
                              for d in devices) or "no devices"
            biggest = max(devices, key=lambda d: usable[d.index], default=None)
            need = needs[m.name, biggest.index].describe() if biggest is not None else "?"
            raise ModelDoesNotFit(f"Model `{m.name}` fits no device, nor a pipeline over the free ones{split_why}: it "
                                  f"needs {need}. Devices: {rooms}. Choose a smaller --dtype, --quantize fp8, or more "
                                  "memory")
        free = [d for d in fitting if d.index not in owner]
        if not free:
            holders = tuple(f"{worker_id(d)} serves `{owner[d.index][0]}`" for d in fitting)
            raise NoDeviceLeft(f"Model `{m.name}` has no free device that holds it "
                               f"({human(needs[m.name, fitting[0].index].total)} needed): {'; '.join(holders)}. "
                               "Serve fewer models at once (--max-loaded-models) or "
                               "pin them (--place)", m.name, holders)
        best = min(free, key=lambda d: (usable[d.index], order[d.index]))
        owner[best.index] = (m.name, FIRST, f"the smallest free device that holds {m.name} (largest needs first)")
    # 3. replicas on the devices left
    count = {m.name: sum(1 for o in owner.values() if o[0] == m.name) for m in models}
    for d in sorted((d for d in devices if d.index not in owner), key=lambda d: (-usable[d.index], order[d.index])):
        candidates = [m for m in models if m.name not in pinned_models and fits(m, d)]
        if not replicas or not candidates:
            smallest = min((needs[m.name, d.index].total for m in models), default=0)
            why = "left free for models loaded on demand" if not replicas else \
                f"no model fits (the smallest needs {human(smallest)})" if models else "no model to serve"
            owner[d.index] = (None, FREE, why)  # type: ignore[assignment]
            continue
        pick = min(candidates, key=lambda m: (count[m.name], -needs[m.name, d.index].total))
        count[pick.name] += 1
        owner[d.index] = (pick.name, REPLICA, f"replica {count[pick.name]} of {pick.name}: the fewest devices of "
                                              "the models that fit here")
    if split.partition is not None and not groups:
        raise PlacementError(f"`--pipeline-partition {','.join(map(str, split.partition))}` is given, but no model is "
                             "split into a pipeline (each fits one device). Add `--pipeline N` or pin one replica "
                             "over several devices: `--place NAME=gpu0+gpu1`")
    # 4. one slot per device, in device order
    slots = []
    for d in devices:
        name, role, reason = owner[d.index]
        need = None if name is None else needs[name, d.index]
        figures = "" if need is None else f" ({need.describe()}; {human(usable[d.index])} usable)"
        slots.append(Slot(d, name, role, reason + figures, need, usable[d.index]))
    return Placement(tuple(slots), tuple(m.name for m in models if any(s.model == m.name for s in slots)),
                     tuple(groups))
