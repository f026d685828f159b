"""The models a router offers, which are loaded where, and loading and unloading them.

`ModelManager` owns the catalog (server/config/models.py: each model's name, directory and
pins) with each model's sizes (`workers.contract.model_size.read_profile`, read once), the
placement the workers start with (server/fleet/placement.py: every model; on demand, the
`--pin-model` ones and the default) and each model's state. Loads run one at a time under a
lock; every transition is logged and shows in `/workers` (`models`), the status page and
`/metrics` (`hetserve_router_model_*`). Trade-off: the requests for a loading model wait in the
dispatcher (bounded by `ready_wait_s`, then 503 with `Retry-After`) rather than in a queue here,
so a load that takes longer than that turns its first requests away; a directory whose sizes
cannot be read is placed as if it took nothing, and its worker then says what is wrong with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum

from server.config.models import ModelEntry
from server.config.settings import RouterSettings
from server.errors import shown
from server.fleet.on_demand import Resident, plan_load
from server.fleet.placement import (
    FREE,
    STAGE,
    ModelAsk,
    Placement,
    PlacementError,
    Slot,
    check_pins,
    place,
    resolve_device,
    split_of,
)
from server.fleet.spec import worker_id
from server.fleet.supervisor import Supervisor
from workers.contract import DeviceInfo, WorkerState, cpu_device
from workers.contract.model_size import ModelProfile, ModelSizeError, read_profile

logger = logging.getLogger(__name__)

RETRY_FAILED_S = 30.0  # a model whose load failed is not loaded again on demand before this


class ModelState(StrEnum):
    LOADED = "loaded"
    LOADING = "loading"
    UNLOADING = "unloading"
    UNLOADED = "unloaded"
    FAILED = "failed"


class ModelUnavailable(Exception):
    """A model that cannot serve now: unknown (404), pinned (409) or unable to load (503)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass
class ServedModel:
    """One model's state on the router's event loop."""

    entry: ModelEntry
    ask: ModelAsk
    pinned: bool  # --pin-model: never unloaded
    state: ModelState = ModelState.UNLOADED
    reason: str = ""
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    unloads: int = 0
    load_seconds: float | None = None  # the last load, from its start to a ready worker
    failed_at: float | None = None


def profile_of(entry: ModelEntry) -> ModelProfile:
    """The model's sizes, or an empty profile saying why they could not be read."""
    try:
        return read_profile(entry.path)
    except ModelSizeError as e:
        logger.warning("model %s: sizes unknown, placed as if it took no memory: %s", entry.name, e)
        return ModelProfile(str(entry.path), None, 0, None, None, 0, 0, 0, 0, 0, 0, f"unknown: {e}")


class ModelManager:
    """The catalog, each model's sizes and state, and the loads and unloads.

    A model's state: `loaded` (a worker serves it), `loading`, `unloading`, `unloaded`, `failed`
    (its last load did not become ready; retried after `RETRY_FAILED_S`). With `--models-dir` or
    `--max-loaded-models`, a request for a model no worker serves asks for it (`request_load`);
    `load` and `unload` also serve `POST /models/{name}/load|unload`. A load plans where the
    model goes and what makes room (server/fleet/on_demand.py, from the workers serving now and
    each model's last use), retires the workers that must go (they finish their requests in
    flight), launches the new ones and waits until one is ready."""

    def __init__(self, settings: RouterSettings, devices: list[DeviceInfo]):
        self.settings = settings
        self.devices = list(devices) or [cpu_device()]
        config = settings.models
        self.on_demand = config.on_demand
        self.models = {e.name: ServedModel(e, ModelAsk(e.name, profile_of(e), config.pins_of(e.name)),
                                           e.name in config.pinned)
                       for e in config.catalog(settings.model_dir)}
        self.default = next(iter(self.models))
        # every pin, also of a model loaded only later, names a device of this host that holds it
        check_pins([m.ask for m in self.models.values()], self.devices, settings.dtype, settings.quantize,
                   fraction=settings.gpu_memory_utilization)
        self.placement = self._initial_placement()
        self.slots = {s.device.index: s for s in self.placement.slots}  # each device's verdict now, with its reason
        for slot in self.placement.slots:
            if slot.model is not None:
                self.models[slot.model].state, self.models[slot.model].reason = ModelState.LOADING, "starting"
        self.supervisor: Supervisor | None = None
        self._lock = asyncio.Lock()
        self._tasks: dict[str, asyncio.Task] = {}

    def _initial_placement(self) -> Placement:
        """Every model; on demand, the pinned ones and the default (within --max-loaded-models)."""
        names = list(self.models)
        if self.on_demand:
            pinned = [n for n in names if self.models[n].pinned]
            room = self.settings.models.max_loaded or len(names)
            names = pinned + ([self.default] if self.default not in pinned and len(pinned) < room else [])
        return place([self.models[n].ask for n in names], self.devices, self.settings.dtype, self.settings.quantize,
                     fraction=self.settings.gpu_memory_utilization, split=split_of(self.settings))

    def assignment(self) -> dict[int, tuple[str, object]]:
        """Device index -> (model, directory) of the workers to start with (a pipeline's first
        stage only: it starts the other stages itself, workers/pipeline/launch.py)."""
        return {s.device.index: (s.model, self.models[s.model].entry.path) for s in self.placement.slots
                if s.model is not None and s.role != STAGE}

    def attach(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    # --- asking for a model --------------------------------------------------------------
    def resolve(self, name: str | None) -> str:
        """The model a request asks for: `name`, the default when None (or, when one model is
        served, whatever it is called); `ModelUnavailable(404)` listing the models otherwise."""
        if name is None or name in self.models:
            return self.default if name is None else name
        if len(self.models) == 1 and not self.on_demand:
            return self.default
        return self.require(name)

    def require(self, name: str) -> str:
        """`name` if it is one of the models offered, exactly; `ModelUnavailable(404)` otherwise."""
        if name not in self.models:
            raise ModelUnavailable(404, f"The model `{shown(name)}` does not exist. Models: {', '.join(self.models)}")
        return name

    def touch(self, name: str) -> None:
        """A request for `name` arrived: it is the most recently used."""
        m = self.models.get(name)
        if m is not None:
            m.last_used = time.monotonic()

    def serving(self, name: str) -> list:
        """The workers that serve (or start to serve) `name`: not stopping."""
        sup = self.supervisor
        return [] if sup is None else [h for h in sup.workers.values()
                                       if h.model == name and h.state != WorkerState.STOPPING]

    def loading(self, name: str) -> bool:
        """Is `name` being loaded now (on demand or by hand)?"""
        return self.models[name].state == ModelState.LOADING if name in self.models else False

    def request_load(self, name: str) -> str:
        """A request found no worker of `name`: start loading it (on demand), or say why not
        (`ModelUnavailable` 503). Returns what is under way."""
        m = self.models[name]
        task = self._tasks.get(name)
        if task is not None and not task.done():
            return f"`{name}` is loading"
        if not self.on_demand:
            raise ModelUnavailable(503, f"The model `{name}` is not loaded ({m.reason or 'unloaded'}); load it with "
                                        f"`POST /models/{name}/load`")
        if m.state == ModelState.FAILED and m.failed_at is not None \
                and time.monotonic() - m.failed_at < RETRY_FAILED_S:
            raise ModelUnavailable(503, f"The model `{name}` failed to load: {m.reason}")
        try:  # what it would unload may still be inside its minimum residence: refused before any start
            if self.supervisor is not None:
                self._plan(name)
        except Resident as e:
            raise ModelUnavailable(503, str(e), e.retry_after) from e
        except PlacementError:
            pass  # the load says why, and marks the model failed
        self._tasks = {n: t for n, t in self._tasks.items() if not t.done()}  # the finished loads' tasks go
        self._tasks[name] = asyncio.create_task(self._load_logged(name), name=f"load-{name}")
        return f"`{name}` is loading"

    async def _load_logged(self, name: str) -> None:
        try:
            await self.load(name)
        except ModelUnavailable as e:
            logger.warning("model %s not loaded: %s", name, e.message)

    # --- loading and unloading --------------------------------------------------------------
    async def load(self, name: str, wait_s: float | None = None) -> ServedModel:
        """Load `name` where `plan_load` puts it and wait until a worker of it is ready (at most
        `wait_s`, default the startup timeout); `ModelUnavailable(503)` when there is no room."""
        m = self.models[name]
        async with self._lock:
            if self.serving(name):
                return m
            assert self.supervisor is not None
            sup, started = self.supervisor, time.monotonic()
            before = m.state, m.reason
            m.state, m.reason = ModelState.LOADING, "planning"
            try:
                plan = self._plan(name)
            except Resident as e:  # not the model's failure: it may load once the residence is over
                m.state, m.reason = before
                raise ModelUnavailable(503, str(e), e.retry_after) from e
            except PlacementError as e:
                m.state, m.reason, m.failed_at = ModelState.FAILED, str(e), time.monotonic()
                raise ModelUnavailable(503, str(e)) from e
            logger.info("loading model %s on %s (%s)", name, ", ".join(s.worker_id for s in plan.start), plan.reason)
            for gone in plan.unload:
                self.models[gone].state, self.models[gone].reason = ModelState.UNLOADING, f"making room for {name}"
            await asyncio.gather(*(sup.retire(worker_id(d), f"making room for {name}")
                                   for d in self._by_index(plan.stop)))
            for gone in plan.unload:
                self._unloaded(gone, f"unloaded to make room for {name}")
            for index in plan.stop:
                self._free(index, f"freed for {name}: {plan.reason}")
            for slot in plan.start:
                self.slots[slot.device.index] = slot
                await sup.launch(slot.device, name, m.entry.path)
            m.reason = f"starting on {', '.join(s.worker_id for s in plan.start)}"
            await self._wait_ready(m, started, wait_s if wait_s is not None else self.settings.startup_timeout_s)
        return m

    def _plan(self, name: str):
        m = self.models[name]
        serving = {h.spec.device.index: h.model for h in self.supervisor.workers.values()
                   if h.state != WorkerState.STOPPING}
        loaded = {n for n in serving.values()}

        def idle_first(n: str) -> tuple[bool, float]:
            return any(h.outstanding for h in self.serving(n)), self.models[n].last_used

        pinned_devices = {resolve_device(t, self.devices).index: n for n, pins in self.settings.models.place
                          for t in pins}
        protected = {n for n, x in self.models.items() if x.pinned or x.state == ModelState.LOADING and n != name}
        return plan_load(m.ask, self.devices, serving, sorted(loaded, key=idle_first), protected,
                         self.settings.models.max_loaded, pinned_devices, self.settings.dtype, self.settings.quantize,
                         self.settings.gpu_memory_utilization, self._residence(loaded))

    def _residence(self, loaded) -> dict[str, float]:
        """Each loaded model's seconds left of its minimum residence, counted from its oldest worker's ready."""
        now, out = time.monotonic(), {}
        for n in loaded:
            since = [h.ready_since for h in self.serving(n) if h.ready_since is not None]
            if since:
                out[n] = self.settings.models.min_residence_s - (now - min(since))
        return out

    def _by_index(self, indices) -> list[DeviceInfo]:
        return [d for d in self.devices if d.index in set(indices)]

    async def _wait_ready(self, m: ServedModel, started: float, wait_s: float) -> None:
        assert self.supervisor is not None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            handles = self.serving(m.entry.name)
            if any(h.routable for h in handles):
                m.state, m.loads, m.reason = ModelState.LOADED, m.loads + 1, ""
                m.load_seconds = time.monotonic() - started
                logger.info("model %s loaded on %s in %.1f s", m.entry.name,
                            ", ".join(h.id for h in handles if h.routable), m.load_seconds)
                return
            if handles and all(h.state == WorkerState.FAILED for h in handles):
                why = "; ".join(f"{h.id}: {h.reason}" for h in handles)
                for h in handles:
                    await self.supervisor.retire(h.id, f"{m.entry.name} failed to load")
                    self._free(h.spec.device.index, f"free: {m.entry.name} failed to load here")
                m.state, m.reason, m.failed_at = ModelState.FAILED, why, time.monotonic()
                logger.error("model %s failed to load: %s", m.entry.name, why)
                raise ModelUnavailable(503, f"The model `{m.entry.name}` failed to load: {why}")
            await self.supervisor.wait_changed(min(1.0, max(0.01, deadline - time.monotonic())))
        m.reason = f"not ready after {wait_s:g} s; still starting"

    async def unload(self, name: str, why: str = "unloaded by request") -> ServedModel:
        """Stop every worker of `name` (they finish their requests in flight); `ModelUnavailable`
        409 for a pinned model."""
        m = self.models[name]
        if m.pinned:
            raise ModelUnavailable(409, f"The model `{name}` is pinned (--pin-model): it stays loaded")
        async with self._lock:
            handles = self.serving(name)
            if handles:
                m.state, m.reason = ModelState.UNLOADING, why
                assert self.supervisor is not None
                await asyncio.gather(*(self.supervisor.retire(h.id, why) for h in handles))
                for h in handles:
                    self._free(h.spec.device.index, f"free: {name} unloaded ({why})")
            self._unloaded(name, why if handles else m.reason or "not loaded")
        return m

    def _free(self, index: int, why: str) -> None:
        """Device `index` serves no model now, for the reason given."""
        slot = self.slots.get(index)
        if slot is not None:
            self.slots[index] = Slot(slot.device, None, FREE, why, None, slot.usable)

    def _unloaded(self, name: str, why: str) -> None:
        m = self.models[name]
        if m.state != ModelState.UNLOADED:
            m.unloads += 1
            logger.info("model %s unloaded (%s)", name, why)
        m.state, m.reason = ModelState.UNLOADED, why

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # --- what the router shows ------------------------------------------------------------
    def state_of(self, name: str) -> ModelState:
        """The model's state; the workers started with the router settle it here (no load of
        theirs runs): loaded once one is ready, failed when all failed."""
        m = self.models[name]
        task = self._tasks.get(name)
        if m.state == ModelState.LOADING and (task is None or task.done()) and not self._lock.locked():
            handles = self.serving(name)
            if any(h.routable for h in handles):
                m.state, m.reason, m.loads = ModelState.LOADED, "", m.loads + 1
            elif handles and all(h.state == WorkerState.FAILED for h in handles):
                m.state, m.reason = ModelState.FAILED, "; ".join(f"{h.id}: {h.reason}" for h in handles)
        return m.state

    def placed(self, index: int) -> dict | None:
        """`/workers` `placement` of device `index`: the model placement gave it (None: free),
        its role (pinned, first, replica, free), why, and the bytes it needs there of those usable."""
        slot = self.slots.get(index)
        if slot is None:
            return None
        return {"worker_id": slot.worker_id, "model": slot.model, "role": slot.role, "reason": slot.reason,
                "need_bytes": None if slot.need is None else slot.need.total, "usable_bytes": slot.usable,
                "need": None if slot.need is None else slot.need.to_dict()}

    def placements(self) -> list[dict]:
        """Every device's `placed`, in device order (free devices too)."""
        return [p for p in (self.placed(d.index) for d in self.devices) if p is not None]

    def describe(self, name: str) -> dict:
        """`/workers` `models[]` and `/v1/models` `placement`: where it is and how it got there."""
        m = self.models[name]
        p = m.ask.profile
        return {
            "name": name, "path": str(m.entry.path), "state": self.state_of(name), "reason": m.reason or None,
            "pinned": m.pinned, "place": list(m.ask.pins), "workers": [h.id for h in self.serving(name)],
            "loads": m.loads, "unloads": m.unloads, "last_load_s": m.load_seconds,
            "idle_s": round(time.monotonic() - m.last_used, 1),
            "size": {"parameters": p.num_parameters, "context_length": p.context_length or None,
                     "architecture": p.architecture, "quantization": p.quantization, "source": p.source},
        }


class ModelCollector:
    """`hetserve_router_model_*`: each model's state, workers, loads and unloads, read at scrape time."""

    def __init__(self, manager: ModelManager):
        self._manager = manager

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = GaugeMetricFamily("hetserve_router_model_state", "1 for the model's current state.",
                                  labels=["model", "state"])
        workers = GaugeMetricFamily("hetserve_router_model_workers", "Workers serving the model (not stopping).",
                                    labels=["model"])
        loads = CounterMetricFamily("hetserve_router_model_loads", "Times the model became loaded.", labels=["model"])
        unloads = CounterMetricFamily("hetserve_router_model_unloads", "Times the model was unloaded.",
                                      labels=["model"])
        seconds = GaugeMetricFamily("hetserve_router_model_load_seconds", "How long the model's last load took, "
                                    "from its start to a ready worker.", labels=["model"])
        for name, m in self._manager.models.items():
            current = self._manager.state_of(name)
            for s in ModelState:
                state.add_metric([name, s], 1.0 if current == s else 0.0)
            workers.add_metric([name], float(len(self._manager.serving(name))))
            loads.add_metric([name], float(m.loads))
            unloads.add_metric([name], float(m.unloads))
            if m.load_seconds is not None:
                seconds.add_metric([name], m.load_seconds)
        yield from (state, workers, loads, unloads, seconds)
