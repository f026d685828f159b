"""The `HETSERVE_SLOWDOWN` value (benchmarks and tests only): how much slower each simulated device runs.

Every simulated device computes on this host's CPU, so a mixed host can only be measured with
devices slowed on purpose. A card differs in kind, not one factor: prefill is bound by compute,
decode by memory bandwidth, and an older card is often far slower at the one than at the other.
So each device gets two factors, one for the prefill tokens of a forward pass and one for its
decode rows (workers/device/slowdown.py applies them):

    3                                every simulated device, both phases
    gpu0=3,gpu2=1.5                  per worker (unlisted workers: 1, or the unnamed entry)
    gpu0=prefill:4,decode:1.5        per phase (a part without `=` continues the worker before it)
    cards  /  cards:sm_80            each device as its catalog card (workers/contract/catalog.py)
                                     against a reference card (default sm_90) that this CPU plays:
                                     prefill by the TFLOPS ratio, decode by the GB/s ratio; a card
                                     faster than the reference runs at 1

The router reads it once and uses it twice: in the worker's configuration (`--slowdown`,
`--prefill-slowdown`) and to weigh a pipeline stage's speed (server/fleet/pipelines.py). Only a
simulated device is slowed, so `device_slowdown` gives every other device 1. Parsed here, torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.contract.catalog import Card, card

ENV_SLOWDOWN = "HETSERVE_SLOWDOWN"
CARDS, DEFAULT_REFERENCE = "cards", "sm_90"
PHASES = ("prefill", "decode")
ACCEPTED = ("a number >= 1, as `3` (every worker) or `gpu0=3,gpu2=1.5`; per phase `gpu0=prefill:4,decode:1.5`; "
            "or `cards` / `cards:sm_80` (each simulated device as its catalog card)")


@dataclass(frozen=True)
class Slowdown:
    """One device's factors: its forward passes' prefill tokens take `prefill` times as long,
    its decode rows `decode` times; `why` says where they came from."""

    prefill: float = 1.0
    decode: float = 1.0
    why: str = ""

    @property
    def slowed(self) -> bool:
        return self.prefill != 1.0 or self.decode != 1.0

    def describe(self) -> str:
        if self.prefill == self.decode:
            return f"{self.decode:g}x"
        return f"prefill {self.prefill:g}x, decode {self.decode:g}x"


NONE = Slowdown()


def _error(raw: str, worker_id: str) -> ValueError:
    return ValueError(f"Invalid {ENV_SLOWDOWN} factor `{raw}` for worker `{worker_id}`. Accepted: {ACCEPTED}")


def _factor(raw: str, worker_id: str) -> float:
    try:
        factor = float(raw)
    except ValueError:
        factor = float("nan")
    if not factor >= 1.0 or not math.isfinite(factor):
        raise _error(raw, worker_id)
    return factor


def _entries(spec: str) -> dict[str | None, list[str]]:
    """Each worker's parts (None: the unnamed entry); a part without `=` continues the one before."""
    entries: dict[str | None, list[str]] = {}
    name: str | None = None
    for part in spec.split(","):
        key, sep, value = part.strip().rpartition("=")
        if sep:
            name = key.strip()
            entries[name] = []
        entries.setdefault(name, []).append(value.strip())
    return entries


def _from_card(value: str, arch: str | None, worker_id: str) -> Slowdown:
    reference_arch = value.partition(":")[2].strip() or DEFAULT_REFERENCE
    reference = card(reference_arch)
    if reference is None:
        raise _error(value, worker_id)
    own: Card | None = card(arch) if arch else None
    if own is None:  # the CPU, or an architecture the catalog has no product for
        return Slowdown(why=f"{arch or 'this device'} has no catalog card")
    return Slowdown(max(1.0, reference.tflops / own.tflops), max(1.0, reference.gbs / own.gbs),
                    f"{own.describe()} against {reference.describe()}")


def slowdown_of(spec: str, worker_id: str, arch: str | None = None) -> Slowdown:
    """This worker's factors in a `HETSERVE_SLOWDOWN` value (1 when it is not listed); `arch`: its
    architecture token, which `cards` needs. `ValueError` names a bad value and lists the forms."""
    spec = spec.strip()
    if not spec:
        return NONE
    entries = _entries(spec)
    parts = entries.get(worker_id, entries.get(None, ["1"]))
    if len(parts) == 1 and (parts[0] == CARDS or parts[0].startswith(CARDS + ":")):
        return _from_card(parts[0], arch, worker_id)
    if len(parts) == 1 and ":" not in parts[0]:
        factor = _factor(parts[0], worker_id)
        return Slowdown(factor, factor, f"{ENV_SLOWDOWN} {factor:g}x")
    phases: dict[str, float] = {}
    for part in parts:
        phase, sep, raw = part.partition(":")
        if not sep or phase.strip() not in PHASES or phase.strip() in phases:
            raise _error(",".join(parts), worker_id)
        phases[phase.strip()] = _factor(raw.strip(), worker_id)
    found = Slowdown(phases.get("prefill", 1.0), phases.get("decode", 1.0))
    return Slowdown(found.prefill, found.decode, f"{ENV_SLOWDOWN} {found.describe()}")


def slowdown_factor(spec: str, worker_id: str) -> float:
    """This worker's one factor (its decode factor) in a `HETSERVE_SLOWDOWN` value (1.0 when it is
    not listed)."""
    return slowdown_of(spec, worker_id).decode


def device_slowdown(spec: str, worker_id: str, simulated: bool, arch: str | None = None) -> Slowdown:
    """The factors a device's worker runs slowed by: its `slowdown_of` when it is simulated, else none."""
    return slowdown_of(spec, worker_id, arch) if simulated else NONE
