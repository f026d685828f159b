"""Routing's first stage: which workers may take a request, or why none can (a pure function).

A request may constrain where it runs through headers that work the same on every route
(`X-Hetserve-Worker`, `X-Hetserve-Min-Capability`, `X-Hetserve-Fp8`; docs/routing.md), and it is
for one model (server/fleet/models.py resolves the name): only that model's workers may take it,
so every later stage (the pick, retries, stream migration) stays among them. `eligible` returns
the workers that may take it now or a refusal with its reason (`Filtered`); the dispatcher then
asks the router to pick among them, so the stages never call back into each other. Trade-off:
the router counts the requests it has in flight per worker instead of asking workers for their
queue depth, which is exact for requests that come through this router and costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from server.errors import shown
from server.fleet.handle import WorkerHandle
from workers.contract import (
    EMULATED,
    FP8_CONVENTIONS,
    HEADER_FP8,
    HEADER_MIN_CAPABILITY,
    HEADER_PIN_WORKER,
    NATIVE,
    Capability,
    CapabilityError,
    WorkerState,
)

HEADER_SESSION = "X-Session-Id"  # keeps a conversation on one worker (server/routing/sessions.py)
MAX_SESSION_CHARS = 256  # longer session ids are cut: they only need to tell sessions apart

_FP8_ALIASES = {"native": NATIVE, NATIVE: NATIVE, "e4m3": NATIVE, EMULATED: EMULATED}

ELIGIBLE, UNSATISFIABLE, OVERLOADED, WAIT, UNAVAILABLE = (
    "eligible", "unsatisfiable", "overloaded", "wait", "unavailable")
UNLOADED = "unloaded"  # no worker serves the request's model


class ConstraintError(ValueError):
    """A constraint header with a value that cannot be understood (422)."""


@dataclass(frozen=True)
class Constraints:
    worker: str | None = None
    min_capability: Capability | None = None
    fp8: str | None = None
    session: str | None = None  # a preference, not a constraint: the conversation's worker while it can serve
    model: str | None = None  # the model's name; None: any worker (a router of one model, tests)
    lora: str | None = None  # the LoRA adapter the request runs with (its model's workers hold it)

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_capability", Capability.parse_optional(self.min_capability))

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.worker, self.min_capability, self.fp8))

    def describe(self) -> str:
        parts = [] if self.model is None else [f"model `{shown(self.model)}`"]
        if self.lora is not None:
            parts.append(f"LoRA adapter `{shown(self.lora)}`")
        if self.worker is not None:
            parts.append(f"worker `{shown(self.worker)}`")
        if self.min_capability is not None:
            parts.append(f"capability >= `{self.min_capability.label}`")
        if self.fp8 is not None:
            parts.append(f"fp8 `{self.fp8}`")
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class Filtered:
    """The filter's verdict: the workers that may take the request, or why none may.

    ELIGIBLE: ready, matching, breaker admitting, not the process that already failed this
    request, room in its queue. The refusals: UNSATISFIABLE (422, no worker can ever satisfy the
    constraints), OVERLOADED (429, every matching worker's queue is full), WAIT (matching workers
    exist but none is ready right now, or every ready one has its circuit breaker open),
    UNAVAILABLE (503, none left to try), UNLOADED (no worker of the model at all, or only
    stopping ones: the dispatcher loads the model, or answers 503)."""

    kind: str  # ELIGIBLE | UNSATISFIABLE | OVERLOADED | WAIT | UNAVAILABLE | UNLOADED
    reason: str
    workers: tuple[WorkerHandle, ...] = ()  # ELIGIBLE: never empty, in device order


def parse_capability(value: str) -> Capability:
    """A header's minimum capability: `X.Y` (e.g. 8.9) or `sm_XY` (e.g. sm_89)."""
    text = value.strip().lower()
    try:
        if "." in text or text.startswith("sm_"):
            return Capability.parse(text)
    except CapabilityError:
        pass
    raise ConstraintError(
        f"Invalid minimum capability `{shown(value)}`. Accepted: `X.Y` (e.g. 8.9) or `sm_XY` (e.g. sm_89)")


def parse_constraints(headers: Mapping[str, str]) -> Constraints:
    """Constraints from request headers (names are case-insensitive); empty values are ignored."""
    worker = (headers.get(HEADER_PIN_WORKER.lower()) or "").strip() or None
    raw_cap = (headers.get(HEADER_MIN_CAPABILITY.lower()) or "").strip()
    raw_fp8 = (headers.get(HEADER_FP8.lower()) or "").strip()
    fp8 = None
    if raw_fp8:
        fp8 = _FP8_ALIASES.get(raw_fp8.lower())
        if fp8 is None:
            raise ConstraintError(f"Invalid fp8 convention `{shown(raw_fp8)}`. Accepted: {', '.join(FP8_CONVENTIONS)}")
    session = (headers.get(HEADER_SESSION.lower()) or "").strip()[:MAX_SESSION_CHARS] or None
    return Constraints(worker=worker, min_capability=parse_capability(raw_cap) if raw_cap else None, fp8=fp8,
                       session=session)


def matches(handle: WorkerHandle, c: Constraints) -> tuple[bool | None, str]:
    """(True, _) matches; (False, why) never will; (None, why) unknown until it reports (fp8)."""
    if c.model is not None and handle.model != c.model:
        return False, f"{handle.id} serves {handle.model}"
    if c.worker is not None and not handle.answers_to(c.worker):
        return False, f"{handle.id} has another id, index and UUID"
    if c.min_capability is not None:
        cap = handle.capability
        if cap is None or cap < c.min_capability:
            return False, f"{handle.id} has capability {handle.capability_label}"
    if c.fp8 is not None:
        conv = handle.fp8_convention
        if conv is None:
            return None, f"{handle.id} has not reported its fp8 convention yet"
        if conv != c.fp8:
            return False, f"{handle.id} uses fp8 {conv}"
    return True, "matches"


def eligible(workers: Iterable[WorkerHandle], c: Constraints, capacity: int,
             exclude: Mapping[str, int] | None = None) -> Filtered:
    """The workers that may take one request now, or the refusal (see `Filtered`).

    `exclude` maps worker id -> the generation (process) that already failed this request; a
    worker restarted since then is eligible again.
    """
    exclude = exclude or {}
    candidates: list[WorkerHandle] = []
    refused: list[str] = []
    served = c.model is None
    for h in workers:
        served = served or (h.model == c.model and h.state != WorkerState.STOPPING)
        ok, why = matches(h, c)
        if ok is False:
            refused.append(why)
        elif h.state == WorkerState.FAILED:
            refused.append(f"{h.id} failed ({h.reason})")
        elif h.state == WorkerState.STOPPING:
            refused.append(f"{h.id} is stopping ({h.retiring})")
        else:
            candidates.append(h)
    if not served:
        return Filtered(UNLOADED, f"No worker serves model `{shown(c.model)}`")
    if not candidates:
        return Filtered(UNSATISFIABLE, f"No worker satisfies {c.describe()}: {'; '.join(refused) or 'no workers'}")
    ready = [h for h in candidates if h.routable and matches(h, c)[0] and exclude.get(h.id) != h.generation]
    if ready:
        admitted = [h for h in ready if h.breaker.admits()]
        if not admitted:
            opened = ", ".join(f"{h.id} (retry in {h.breaker.retry_in_s():.1f}s)" for h in ready)
            return Filtered(WAIT, f"The circuit breaker of every matching ready worker is open: {opened}")
        free = [h for h in admitted if h.outstanding < capacity]
        if not free:
            return Filtered(OVERLOADED, f"All {len(admitted)} matching workers have {capacity} requests in flight")
        return Filtered(ELIGIBLE, f"{len(free)} could take it", tuple(free))
    waiting = [h for h in candidates if not h.routable]
    if waiting:
        states = ", ".join(f"{h.id} {h.state}" for h in waiting)
        return Filtered(WAIT, f"No matching worker is ready yet ({states})")
    return Filtered(UNAVAILABLE, "Every matching ready worker already failed this request")
