"""The router's live view of one worker: state, process, what it reported, its load.

A `WorkerHandle` is mutable and lives on the router's event loop only (no locks): the supervisor
moves it through its states, the dispatcher counts the requests it has sent there. `snapshot()`
is the `/workers` entry; everything in it is either what the worker reported about itself
(`/capability`) or, before it has, what the router knows from the inventory. Beside its state,
each worker has a circuit breaker (server/fleet/breaker.py), the verdict of its last health
probe (server/fleet/probe.py) and that of its last canary check, which may hold a ready worker
out of rotation (`canary_hold`). Trade-off: one mutable object shared by the supervisor, the
dispatcher and the canary, kept safe by the single event loop rather than by copies or locks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from server.fleet.breaker import BreakerPolicy, CircuitBreaker
from server.fleet.canary_record import FIRST_CHECK, CanaryRecord
from server.fleet.client import WorkerClient
from server.fleet.probe import ProbeVerdict
from server.fleet.spec import WorkerSpec
from workers.contract import (
    DEVICE_FIELDS,
    ENV_TRITON_CACHE_DIR,
    Capability,
    CapabilityPayload,
    DeterministicDescription,
    WorkerState,
)


@dataclass(eq=False)
class WorkerHandle:
    """One worker, serving one model (`model`, its name), through its states: `starting` (first
    start, not ready yet) -> `ready` <-> `unhealthy` (alive but failing health checks, or hung
    and being replaced: not routed to); a crash -> `restarting` (until ready again); a start that
    failed at a step (exit code 3) or kept crashing -> `failed` (not restarted, `reason` says
    why); its model unloading -> `stopping` (until its process has exited, then it is gone)."""

    spec: WorkerSpec
    state: WorkerState = WorkerState.STARTING
    reason: str | None = None  # why it is not ready (current step, failure, last exit)
    step: str | None = None  # the startup step the status file reports
    pid: int | None = None
    restarts: int = 0
    generation: int = 0  # +1 per spawn: a request that failed on generation g may retry g+1
    info: CapabilityPayload | None = None  # the worker's /capability answer, once ready
    live_capacity: dict = field(default_factory=dict)  # what its last /health said changed (free KV blocks)
    outstanding: int = 0  # requests the router has in flight there
    picks: int = 0  # requests ever sent there (tie-break of least-outstanding)
    ready_since: float | None = None
    last_exit: str | None = None
    client: WorkerClient | None = None
    process: asyncio.subprocess.Process | None = None
    check_now: asyncio.Event = field(default_factory=asyncio.Event)
    breaker: CircuitBreaker = field(default_factory=lambda: CircuitBreaker(BreakerPolicy()))
    probe: ProbeVerdict | None = None  # the last health probe's verdict
    exit_cause: str | None = None  # why the router stopped this process itself (a hang), for `last_exit`
    stopped_generation: int = -1  # the last process the router stopped itself (`stopping`)
    canary: CanaryRecord | None = None  # the last canary check's verdict
    canary_hold: str | None = None  # why the canary keeps the worker out of rotation (kept across restarts)
    retiring: str | None = None  # why it is stopping for good (its model unloads): not restarted

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def model(self) -> str:
        """The name of the model this worker serves (server/config/models.py)."""
        return self.spec.model

    @property
    def capability(self) -> Capability | None:
        return self.spec.device.capability

    @property
    def capability_label(self) -> str:
        return self.spec.device.capability_label

    @property
    def fp8_convention(self) -> str | None:
        """The device's fp8 convention, whether or not a layer uses it (None until it has reported):
        what the routing filter's `X-Hetserve-Fp8` matches, a capability of the device."""
        return None if self.info is None else self.info.fp8.convention

    @property
    def fp8_label(self) -> str | None:
        """What fp8 is in this worker's run: its convention where a layer computes in fp8, else
        `not used (bfloat16)` (the dtype it runs in); a worker that does not say keeps its convention."""
        if self.info is None:
            return None
        return self.info.fp8.label or self.info.fp8.convention

    def fp8_entry(self) -> dict:
        """`/workers` `fp8`: the device's `convention` and its `reason` (what its fp8 layers run in,
        and what `X-Hetserve-Fp8` filters on), `used` (any layer computes in fp8: `--quantize fp8`, an
        fp8 checkpoint), `label` (the convention when used, else `not used (bfloat16)`: what the ready
        line, `X-Fp8-Convention` and the status page show) and `used_reason`."""
        fp8 = (self.info or CapabilityPayload()).fp8.model_dump()
        if fp8.get("used") is False:
            dtype = (self.info.model.dtype if self.info is not None else None) or "the model dtype"
            fp8["used_reason"] = f"no `--quantize fp8` and no fp8 checkpoint: every layer computes in {dtype}"
        elif fp8.get("used"):
            fp8["used_reason"] = f"fp8 layers run {fp8.get('label')}"
        return fp8

    @property
    def routable(self) -> bool:
        return self.state == WorkerState.READY and self.client is not None and self.canary_hold is None

    @property
    def canary_suspect(self) -> bool:
        """The canary found this worker suspect, or keeps it out of rotation for that."""
        return (self.canary is not None and self.canary.suspect) or self.canary_hold not in (None, FIRST_CHECK)

    def stopping(self, why: str) -> None:
        """The router stops this process itself (hung, unhealthy too long, a canary's restart):
        `why` becomes its exit's cause, and requests that lose it did not witness a crash."""
        self.exit_cause, self.stopped_generation = why, self.generation

    def crashed_under(self, generation: int) -> bool:
        """Did process `generation` die on its own (not stopped by the router) with a request on it?"""
        return generation != self.stopped_generation

    def request_outcome(self, generation: int, ok: bool | None, why: str = "") -> None:
        """Feed the breaker: a request sent to process `generation` succeeded (True), failed
        (False: `why`) or ended without a verdict (None). Outcomes of an earlier process are ignored."""
        if generation != self.generation:
            return
        if ok is None:
            self.breaker.on_neutral()
        elif ok:
            self.breaker.on_success()
        else:
            self.breaker.on_failure(why)

    def answers_to(self, name: str) -> bool:
        """Is `name` this worker's id, its device index or its device UUID (any case)?"""
        device = self.spec.device
        return name.strip().lower() in (self.id.lower(), str(device.index), device.uuid.lower())

    def device_dict(self) -> dict:
        """The inventory's description, overridden by what the worker reported."""
        base = self.spec.device.to_dict()
        if self.info is not None:
            reported = self.info.device.model_dump(exclude_unset=True)
            base.update({k: reported[k] for k in DEVICE_FIELDS if k in reported})
            # the fp8 the device supports (a capability), used or not: `fp8` says what runs
            base["fp8"] = {"convention": self.info.fp8.convention, "reason": self.info.fp8.reason}
        return base

    def load(self, max_batch: int) -> dict:
        """Requests in flight there, split at the worker's batch size into running and queued."""
        running = min(self.outstanding, max_batch)
        return {"running": running, "queued": self.outstanding - running}

    def snapshot(self, max_batch: int) -> dict:
        """This worker's `/workers` entry."""
        info = self.info or CapabilityPayload()
        return {
            "id": self.id,
            "state": self.state,
            "pid": self.pid,
            "threads": self.spec.threads,  # CPU threads it computes with (server/fleet/spec.py `thread_choice`)
            "restarts": self.restarts,
            "reason": self.reason,
            "device": self.device_dict(),
            "fp8": self.fp8_entry(),
            "kernels": {layer: k.model_dump(exclude_none=True) for layer, k in info.kernels.items()},
            "triton_cache": info.triton_cache or self.spec.environ().get(ENV_TRITON_CACHE_DIR),
            "load": self.load(max_batch),
            "capacity": {**info.capacity, **self.live_capacity} if info.capacity else None,
            "model": {"name": self.model, **info.model.model_dump(exclude={"chat_template"}, exclude_none=True)},
            "last_exit": self.last_exit,
            "breaker": self.breaker.snapshot(),
            "health": None if self.probe is None else self.probe.snapshot(),
            "deterministic": (info.deterministic or DeterministicDescription()).model_dump(exclude_none=True),
            "canary": self.canary_snapshot(),
            "pipeline": info.pipeline,  # a pipeline replica's stages: layers, device, kernels, fp8, bytes
            "compile": self.compile_entry(),
            # what it still builds or compiles behind its serving, and each kernel on its torch path (why),
            # as the last `/health` said, else as `/capability` said at start
            "preparing": self.live("preparing", info.preparing),
            "fallbacks": self.live("fallbacks", info.fallbacks),
            "loras": None if self.probe is None else self.probe.loras,  # its LoRA adapters, as its last /health said
            # speculative decoding as the last `/health` said, else as `/capability` said at start
            "speculative": (self.probe.speculative if self.probe is not None else None) or info.speculative,
        }

    def live(self, name: str, described):
        """`name` as the last `/health` said, else `described` (from `/capability` at start)."""
        said = None if self.probe is None else getattr(self.probe, name)
        return described if said is None else said

    def compile_entry(self) -> dict | None:
        """`/workers` `compile`: the decode step's compilation as the last `/health` said (it goes
        on after ready under `--compile auto`), else as `/capability` said at start."""
        live = None if self.probe is None else self.probe.compile
        described = live or (self.info.compile if self.info is not None else None)
        return None if described is None else described.model_dump(exclude_none=True)

    def canary_snapshot(self) -> dict | None:
        """`/workers` `canary`: the last check's verdict, and whether it holds the worker out of rotation."""
        if self.canary is None and self.canary_hold is None:
            return None
        out = {} if self.canary is None else self.canary.snapshot()
        if self.canary_hold is not None:
            out["held"] = self.canary_hold
        return out


def read_status(path: Path) -> dict:
    """The worker's status file ({} when absent or half-written)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
