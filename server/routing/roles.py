"""Each worker's role under disaggregated prefill: `prefill`, `decode` or `both`, and why.

Explicit roles (`--prefill gpu0 --decode gpu1,gpu2`) name workers by id, index or UUID; a worker
named in one list has that role, one in both does both, and an unlisted one takes the other role
when only one list is given (both when two are). `auto` chooses from each device's catalog card
(workers/contract/catalog.py: published dense TFLOPS, which bound a prefill, and GB/s, which bound
a decode step): the devices of the highest compute prefill long prompts (and keep serving ordinary
requests, `both`) and the others decode them, but only when
the prefill device's comparative advantage, (its TFLOPS / the best other's) / (its GB/s / the
best other's), is at least `AUTO_MIN_ADVANTAGE`: each device is then better at its own phase
than the other is (an L40S beside an A100: 2.7), while a card that is faster at both (an H100
beside a T4: 1.5) or identical devices (1.0) keep today's routing, where every worker does both.
These are the start's roles: once every worker's speed is measured, `auto` follows the measured
figures instead (server/routing/split.py `measured_roles`), so a device that runs slower than its
card loses its role. Trade-off: published figures until then, which a card throttled or shared
may not meet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from server.config.disaggregate import AUTO, EXPLICIT, DisaggregateConfig
from server.errors import UsageError
from workers.contract.catalog import card
from workers.contract.device import DeviceInfo
from workers.contract.slowdown import Slowdown

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
AUTO_MIN_ADVANTAGE = 2.0  # comparative advantage from which `auto` splits the phases (see above)


@dataclass(frozen=True)
class Roles:
    """Worker id -> role (unlisted: both) and the reason of the whole choice."""

    by_worker: Mapping[str, str] = field(default_factory=dict)
    reason: str = "disaggregation is off (--disaggregate off)"

    def role(self, worker_id: str) -> str:
        return self.by_worker.get(worker_id, BOTH)

    @property
    def active(self) -> bool:
        """Some worker has a role of its own: long prompts are handed off (prefilled where prefill
        may run, decoded where decode may, which can be the same worker when it does both)."""
        return any(r != BOTH for r in self.by_worker.values())

    def describe(self) -> dict:
        return {"active": self.active, "roles": dict(self.by_worker), "reason": self.reason}


def _matches(token: str, worker_id: str, device: DeviceInfo | None) -> bool:
    t = token.strip().lower()
    if t == worker_id.lower():
        return True
    return device is not None and t in (str(device.index), device.uuid.lower())


def _resolve(flag: str, tokens: Sequence[str], workers: Mapping[str, DeviceInfo | None]) -> list[str]:
    ids = []
    for t in tokens:
        found = [w for w, d in workers.items() if _matches(t, w, d)]
        if not found:
            known = ", ".join(workers) or "none"
            raise UsageError(f"`{flag} {t}` names no worker. Accepted: {known} (a worker id, device index or UUID)")
        ids.append(found[0])
    return ids


def explicit_roles(config: DisaggregateConfig, workers: Mapping[str, DeviceInfo | None]) -> Roles:
    """The roles `--prefill`/`--decode` give; `UsageError` for a device that is no worker's, or
    roles that leave no worker to prefill or none to decode."""
    prefill = _resolve("--prefill", config.prefill, workers)
    decode = _resolve("--decode", config.decode, workers)
    rest = BOTH if (prefill and decode) else (DECODE if prefill else PREFILL)
    roles = {}
    for w in workers:
        p, d = w in prefill, w in decode
        roles[w] = BOTH if (p and d) else PREFILL if p else DECODE if d else rest
    if not any(r in (DECODE, BOTH) for r in roles.values()):
        raise UsageError(f"`--prefill {','.join(config.prefill)}` leaves no worker to decode. Accepted: at least "
                         f"one of {', '.join(workers)} outside --prefill (or in --decode too)")
    if not any(r in (PREFILL, BOTH) for r in roles.values()):
        raise UsageError(f"`--decode {','.join(config.decode)}` leaves no worker to prefill. Accepted: at least "
                         f"one of {', '.join(workers)} outside --decode (or in --prefill too)")
    named = ", ".join(f"{w} {r}" for w, r in roles.items())
    return Roles(roles, f"explicit roles (--prefill/--decode): {named}")


def auto_roles(workers: Mapping[str, DeviceInfo | None], slowed: Mapping[str, Slowdown] | None = None) -> Roles:
    """The roles `--disaggregate auto` chooses from the devices' catalog cards (module docstring);
    a simulated device slowed on purpose (`slowed`, from `$HETSERVE_SLOWDOWN`) counts as its card
    with its compute and bandwidth divided by its prefill and decode factors."""
    cards = {}
    for w, d in workers.items():
        c = None if d is None else card(d.arch or d.capability_label)
        if c is None:
            return Roles({}, f"auto: not disaggregated: {w} has no catalog card (a CPU or an unknown architecture)")
        s = (slowed or {}).get(w)
        if s is not None and s.slowed:
            c = replace(c, arch=f"{c.arch} (slowed {s.describe()})", tflops=c.tflops / s.prefill, gbs=c.gbs / s.decode)
        cards[w] = c
    if len(cards) < 2:
        return Roles({}, "auto: not disaggregated: one worker")
    top = max(c.tflops for c in cards.values())
    prefill = [w for w, c in cards.items() if c.tflops == top]
    others = [w for w in cards if w not in prefill]
    if not others:
        return Roles({}, "auto: not disaggregated: every device has the same compute")
    p = cards[prefill[0]]
    b = max((cards[w] for w in others), key=lambda c: c.gbs)
    advantage = (p.tflops / b.tflops) / (p.gbs / b.gbs)
    figures = (f"{p.arch} {p.tflops:g} TFLOPS / {p.gbs:g} GB/s beside {b.arch} {b.tflops:g} TFLOPS / "
               f"{b.gbs:g} GB/s: comparative advantage {advantage:.2f}")
    if advantage < AUTO_MIN_ADVANTAGE:
        return Roles({}, f"auto: not disaggregated: {figures} < {AUTO_MIN_ADVANTAGE:g}")
    roles = {w: BOTH if w in prefill else DECODE for w in cards}
    return Roles(roles, f"auto: {', '.join(prefill)} prefill, {', '.join(others)} decode ({figures})")


def resolve_roles(config: DisaggregateConfig, workers: Mapping[str, DeviceInfo | None],
                  slowed: Mapping[str, Slowdown] | None = None) -> Roles:
    """The roles of `workers` (id -> its device, None for one without a single device)."""
    if config.mode == EXPLICIT:
        return explicit_roles(config, workers)
    if config.mode == AUTO:
        return auto_roles(workers, slowed)
    return Roles()
