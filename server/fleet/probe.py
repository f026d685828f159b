"""One health probe of a worker, and its verdict: ok, busy, failing, down or hung.

The supervisor probes every ready worker's `/health` once per interval. A worker is **hung**
when its probe gets no answer within the probe timeout and the process did not compute meanwhile
(stopped, or a deadlocked event loop: the socket accepts, nothing answers), or when it answers but
reports work pending and no completed engine step for longer than the stall timeout (a stuck
kernel, a deadlocked engine thread), unless the process computed since the last probe: a step
slowed by a loaded host is left running up to `COMPUTING_STALL_FACTOR` stall timeouts. A hung
worker is replaced at once. A probe unanswered while
the process used CPU (its own `/proc/<pid>/stat`) is **busy**: a loaded host, or a first compile
holding the interpreter; the supervisor tolerates `MAX_BUSY_PROBES` of them in a row. **Down**
(nothing listens) means the process is gone or going; **failing** (a non-200 answer, a broken
connection) is counted and tolerated for a few probes. Trade-off: a worker spinning without
progress is replaced only after the busy probes run out, not at its first slow answer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pydantic import ValidationError

from server.fleet.client import WorkerClient, WorkerDown, WorkerGone, WorkerHTTPError
from workers.contract import CapabilityPayload, CompileDescription, EngineLiveness, HealthPayload

BUSY_CPU_SHARE = 0.2  # of one core over an unanswered probe: the worker computes, it is not stopped
MAX_BUSY_PROBES = 6  # unanswered probes in a row tolerated from a worker that computes
STALL_CPU_SHARE = 0.05  # of one core since the last probe: a step is computing (a deadlock uses ~0)
COMPUTING_STALL_FACTOR = 4  # a computing step is taken for hung only past this many stall timeouts


class Probe(StrEnum):
    OK = "ok"
    SLOW = "slow"  # a step past the stall timeout while the worker computes: left running
    BUSY = "busy"
    FAILING = "failing"
    DOWN = "down"
    HUNG = "hung"


@dataclass(frozen=True)
class ProbeVerdict:
    kind: Probe
    why: str
    engine: EngineLiveness | None = None  # what the worker reported about its engine, if it answered
    capacity: dict | None = None  # the worker's changing KV figures (`kv_blocks_free`), if it answered
    compile: CompileDescription | None = None  # its decode step's compilation, which goes on after ready
    loras: dict | None = None  # its LoRA adapters (workers/lora/metrics.py `describe_loras`), if it has a table
    speculative: dict | None = None  # its speculative decoding now (method, k, acceptance, reason)
    preparing: list[str] | None = None  # what it still builds or compiles behind its serving, in words
    fallbacks: dict[str, str] | None = None  # each of its kernels on its torch path -> why

    def snapshot(self) -> dict:
        """`/workers` `health`: the last probe's verdict and the engine's liveness."""
        out: dict = {"probe": str(self.kind)}
        if self.kind != Probe.OK:
            out["why"] = self.why
        if self.engine is not None:
            out["engine"] = self.engine.model_dump()
        return out


def judge(code: int, body: dict, stall_timeout_s: float, computing: float | None = None) -> ProbeVerdict:
    """The verdict on an answered probe (`code`, parsed `body`); `computing`: the worker's share of
    a core since its last probe (None: unknown), which tells a long step from a stuck engine."""
    try:
        payload = HealthPayload.model_validate(body)
    except ValidationError:
        payload = HealthPayload()
    engine, capacity, compiled, spec = payload.engine, payload.capacity, payload.compile, payload.speculative
    said = {"preparing": payload.preparing, "fallbacks": payload.fallbacks}  # what is in use on the worker now
    if engine is not None and engine.pending and engine.last_step_age_s > stall_timeout_s:
        age = engine.last_step_age_s
        if computing is not None and computing >= STALL_CPU_SHARE and age <= COMPUTING_STALL_FACTOR * stall_timeout_s:
            return ProbeVerdict(Probe.SLOW, f"a step running for {age:.1f}s while the worker computed "
                                          f"({computing:.2f} of a core): slow, not stalled", engine, capacity, compiled,
                                **said)
        return ProbeVerdict(Probe.HUNG, f"engine stalled: work pending and no step for {age:.1f}s "
                                        f"(stall timeout {stall_timeout_s:g}s"
                                        + (f", {computing:.2f} of a core used" if computing is not None else "")
                                        + ")", engine, capacity, compiled, **said)
    if code == 200:
        return ProbeVerdict(Probe.OK, "ok", engine, capacity, compiled, payload.loras, speculative=spec, **said)
    return ProbeVerdict(Probe.FAILING, f"/health answered {code} {payload.status or ''}".strip(), engine, capacity,
                        compiled, speculative=spec, **said)


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system, every thread) the process `pid` has used, from `/proc/<pid>/stat`;
    None where it cannot be read (no such process, no procfs) or the process is stopped."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("T", "t"):  # stopped (SIGSTOP) or traced: not computing whatever its counters say
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ready_capability(client: WorkerClient) -> CapabilityPayload | None:
    """A starting worker's `/capability` once its `/health` says ready; None if not yet."""
    try:
        code, _ = await client.health()
        if code != 200:
            return None
        return await client.capability()
    except (*WorkerGone, WorkerHTTPError, ValueError):
        return None


class CpuWatch:
    """A worker process's share of one core between two readings (`share`)."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self._last: tuple[float, float] | None = None

    def share(self) -> float | None:
        """Its CPU seconds per second since the last call (None at the first or unreadable)."""
        now, cpu = time.monotonic(), cpu_seconds(self.pid)
        last, self._last = self._last, None if cpu is None else (now, cpu)
        if last is None or cpu is None or now <= last[0]:
            return None
        return (cpu - last[1]) / (now - last[0])


async def probe(client: WorkerClient, timeout_s: float, stall_timeout_s: float,
                pid: int | None = None, watch: CpuWatch | None = None) -> ProbeVerdict:
    """Probe the worker's `/health` once (see the module docstring); `pid`: the worker's process,
    whose CPU time tells a busy worker from a stopped one when the probe goes unanswered; `watch`:
    its CPU share since the last probe, which tells a long step from a stalled engine."""
    before = cpu_seconds(pid)
    try:
        code, body = await client.health(timeout_s)
    except TimeoutError:
        after = cpu_seconds(pid)
        if before is not None and after is not None and after - before >= BUSY_CPU_SHARE * timeout_s:
            return ProbeVerdict(Probe.BUSY, f"/health did not answer within {timeout_s:g}s while the worker "
                                            f"computed ({after - before:.1f}s of CPU): busy, not hung")
        return ProbeVerdict(Probe.HUNG, f"/health did not answer within {timeout_s:g}s")
    except WorkerDown as e:
        return ProbeVerdict(Probe.DOWN, f"unreachable: {e!r}")
    except WorkerGone as e:
        return ProbeVerdict(Probe.FAILING, f"health check failed: {e!r}")
    return judge(code, body, stall_timeout_s, None if watch is None else watch.share())


class Act(StrEnum):
    """What a probe's verdict calls for, given the ones before it."""

    KEEP = "keep"  # nothing changes
    RECOVERED = "recovered"  # answered again: back to ready if it was unhealthy
    UNHEALTHY = "unhealthy"  # failing too often: out of rotation
    REPLACE = "replace"  # hung, or busy too long: its requests back, then a restart
    KILL = "kill"  # unhealthy for too long


@dataclass
class Tally:
    """One worker's run of verdicts: failures in a row, busy probes in a row, and since when it has
    been unhealthy. `count` turns each verdict into what it calls for, with its reason."""

    unhealthy_after: int  # consecutive failed probes
    kill_after_s: float  # unhealthy this long: killed
    failures: int = 0
    busy: int = 0
    unhealthy_since: float | None = None

    def count(self, verdict: ProbeVerdict, urgent: bool, ready: bool) -> tuple[Act, str]:
        """`urgent`: a request saw the worker unreachable; `ready`: it is in rotation now."""
        why = verdict.why
        self.busy = self.busy + 1 if verdict.kind == Probe.BUSY else 0
        if self.busy > MAX_BUSY_PROBES:
            return Act.REPLACE, f"{why}, {self.busy} probes in a row"
        if verdict.kind == Probe.HUNG:
            return Act.REPLACE, why
        if verdict.kind in (Probe.OK, Probe.SLOW, Probe.BUSY):
            self.failures, self.unhealthy_since = 0, None
            return Act.RECOVERED, why
        if verdict.kind == Probe.DOWN and urgent:
            self.failures = max(self.failures, self.unhealthy_after - 1)
        self.failures += 1
        if self.unhealthy_since is not None and time.monotonic() - self.unhealthy_since > self.kill_after_s:
            return Act.KILL, why
        if self.failures >= self.unhealthy_after and ready:
            self.unhealthy_since = time.monotonic()
            return Act.UNHEALTHY, why
        return Act.KEEP, why
