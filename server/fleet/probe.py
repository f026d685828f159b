"""One health probe of a worker, and its verdict: ok, failing, down or hung.

The supervisor probes every ready worker's `/health` once per interval. A worker is **hung**
when its probe gets no answer within the probe timeout (a stopped process, a deadlocked
event loop: the socket accepts, nothing answers), or when it answers but reports work
pending and no completed engine step for longer than the stall timeout (a stuck kernel, a
deadlocked engine thread: the HTTP side still runs). A hung worker is replaced at once, since
waiting cannot help and its requests are stuck. **Down** (nothing listens on the socket) means
the process is gone or going; **failing** (a non-200 answer, a broken connection) is counted
and tolerated for a few probes, as a draining or briefly overloaded worker answers so.
Trade-off: one missed probe is enough to replace a worker, so the timeout must sit well above
what a healthy worker needs to answer (a few milliseconds); the default is seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import ValidationError

from server.fleet.client import WorkerClient, WorkerDown, WorkerGone
from workers.contract import EngineLiveness, HealthPayload


class Probe(StrEnum):
    OK = "ok"
    FAILING = "failing"
    DOWN = "down"
    HUNG = "hung"


@dataclass(frozen=True)
class ProbeVerdict:
    kind: Probe
    why: str
    engine: EngineLiveness | None = None  # what the worker reported about its engine, if it answered
    capacity: dict | None = None  # the worker's changing KV figures (`kv_blocks_free`), if it answered

    def snapshot(self) -> dict:
        """`/workers` `health`: the last probe's verdict and the engine's liveness."""
        out: dict = {"probe": str(self.kind)}
        if self.kind != Probe.OK:
            out["why"] = self.why
        if self.engine is not None:
            out["engine"] = self.engine.model_dump()
        return out


def judge(code: int, body: dict, stall_timeout_s: float) -> ProbeVerdict:
    """The verdict on an answered probe (`code`, parsed `body`)."""
    try:
        payload = HealthPayload.model_validate(body)
    except ValidationError:
        payload = HealthPayload()
    engine, capacity = payload.engine, payload.capacity
    if engine is not None and engine.pending and engine.last_step_age_s > stall_timeout_s:
        return ProbeVerdict(Probe.HUNG, f"engine stalled: work pending and no step for {engine.last_step_age_s:.1f}s "
                                        f"(stall timeout {stall_timeout_s:g}s)", engine, capacity)
    if code == 200:
        return ProbeVerdict(Probe.OK, "ok", engine, capacity)
    return ProbeVerdict(Probe.FAILING, f"/health answered {code} {payload.status or ''}".strip(), engine, capacity)


async def probe(client: WorkerClient, timeout_s: float, stall_timeout_s: float) -> ProbeVerdict:
    """Probe the worker's `/health` once (see the module docstring)."""
    try:
        code, body = await client.health(timeout_s)
    except TimeoutError:
        return ProbeVerdict(Probe.HUNG, f"/health did not answer within {timeout_s:g}s")
    except WorkerDown as e:
        return ProbeVerdict(Probe.DOWN, f"unreachable: {e!r}")
    except WorkerGone as e:
        return ProbeVerdict(Probe.FAILING, f"health check failed: {e!r}")
    return judge(code, body, stall_timeout_s)
