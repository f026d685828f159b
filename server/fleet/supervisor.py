"""Starts one worker process per device, tracks readiness, restarts crashes, stops cleanly.

Each worker has one lifecycle task on the router's event loop (`Supervisor._lifecycle`): spawn
-> wait until ready -> health-check every second (server/fleet/probe.py) -> on exit, decide
(server/fleet/exits.py, a pure function). A worker that failed to start is marked `failed` with
the step that failed and not restarted (the same start would fail the same way); a crash, a
fatal error while serving or a hung worker is restarted with exponential backoff while the
others keep serving; the placement says which model each serves, and models load and unload
through `launch` and `retire`. No orphans: workers run in their own session, get `--parent-pid`
and, on Linux, `PR_SET_PDEATHSIG`, and their sockets and status files live in a private 0700
run directory removed at stop. Trade-off: a worker that keeps crashing before it ever becomes
ready is given up on after a few tries instead of retried forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from server.config.settings import RouterSettings
from server.fleet.breaker import BreakerPolicy, CircuitBreaker
from server.fleet.client import WorkerClient
from server.fleet.exits import ExitHistory, RestartPolicy, decide_exit, describe_failure
from server.fleet.handle import WorkerHandle, read_status
from server.fleet.kv_tier_dir import close_run, open_run
from server.fleet.pipelines import with_pipelines
from server.fleet.probe import Act, CpuWatch, Probe, Tally, probe, ready_capability
from server.fleet.process import alive, kill, spawn
from server.fleet.spec import (
    build_worker_spec,
    build_worker_specs,
    with_runtime_loras,
    worker_id,
    worker_threads,
)
from workers.contract import DeviceInfo, WorkerState, WorkerStatus, cpu_device

logger = logging.getLogger(__name__)


class Supervisor:
    """Owns the worker processes of one router.

    A Ctrl-C in the terminal reaches only the router (workers run in their own session), which
    then drains and stops them in order (`stop`). Starting and killing a process itself:
    server/fleet/process.py."""

    def __init__(self, devices: list[DeviceInfo], settings: RouterSettings,
                 models: dict[int, tuple[str, Path]] | None = None, pipelines: tuple = ()):
        """`models`: device index -> (model name, directory) of the workers to start (default:
        every device serves the settings' default model); `pipelines`: the replicas over several
        devices (server/fleet/pipelines.py), each started as its first stage."""
        self.settings = settings
        self._pipelines = tuple(pipelines)
        self._devices = list(devices) or [cpu_device()]
        self._models = models
        self._threads, self.threads_reason = worker_threads(settings, self._devices, models)
        self._generations: dict[str, int] = {}  # worker id -> the last generation of a retired worker there
        self.workers: dict[str, WorkerHandle] = {}
        self.run_dir: Path | None = None
        self._tasks: set[asyncio.Task] = set()  # the live workers' lifecycles: each leaves once it ends
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        # LoRA adapters loaded at run time (server/edge/routes/lora.py): a worker (re)started reads them too
        self.runtime_loras: dict[str, Path] = {}

    # --- public ------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the private run directory and spawn every worker (does not wait for ready)."""
        self._init_run_dir()
        self._init_handles()
        self._stop_event = asyncio.Event()
        self._changed = asyncio.Event()
        for handle in self.workers.values():
            self._start_lifecycle(handle)

    def ready(self) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.routable]

    def settled(self) -> bool:
        """Every worker is ready, has failed for good or is stopping."""
        return all(h.state in (WorkerState.READY, WorkerState.FAILED, WorkerState.STOPPING)
                   for h in self.workers.values())

    def all_failed(self) -> bool:
        return bool(self.workers) and all(h.state == WorkerState.FAILED for h in self.workers.values())

    async def wait_changed(self, timeout: float) -> None:
        """Return when any worker changes state, or after `timeout` seconds."""
        event = self._changed
        if event is None:
            await asyncio.sleep(timeout)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    async def wait_settled(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.settled():
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait_changed(min(left, 1.0))
        return True

    def report_unreachable(self, handle: WorkerHandle, generation: int) -> None:
        """The dispatcher could not talk to this worker: check its health now."""
        if handle.generation == generation:
            handle.check_now.set()

    def hold(self, handle: WorkerHandle, why: str, restart: bool = False) -> None:
        """The canary takes `handle` out of rotation (`why`); with `restart`, its process is also
        stopped gracefully (SIGTERM: its requests in flight finish) and the lifecycle restarts it,
        still held until the canary releases it."""
        handle.canary_hold = why
        self._notify()
        if not restart or handle.process is None or handle.process.returncode is not None:
            return
        logger.error("worker %s (pid %s) out of rotation and restarting: %s", handle.id, handle.pid, why)
        handle.stopping(why)
        with contextlib.suppress(ProcessLookupError):
            handle.process.send_signal(signal.SIGTERM)

    def release(self, handle: WorkerHandle) -> None:
        """The canary found `handle` healthy again: back in rotation."""
        handle.canary_hold = None
        self._notify()

    async def launch(self, device: DeviceInfo, model: str, model_dir: Path) -> WorkerHandle:
        """Start a worker serving `model` on `device` (no other worker may be on it); it is
        `starting` until ready, as at startup."""
        assert self.run_dir is not None
        spec = build_worker_spec(device, model, model_dir, self.settings, self.run_dir, os.getpid(), self._threads,
                                 dict(os.environ))
        if spec.id in self.workers:
            raise RuntimeError(f"worker {spec.id} already serves `{self.workers[spec.id].model}`")
        handle = self._handle(spec)
        order = {worker_id(d): i for i, d in enumerate(self._devices)}
        self.workers = dict(sorted({**self.workers, spec.id: handle}.items(), key=lambda kv: order.get(kv[0], 0)))
        self._start_lifecycle(handle)
        self._notify()
        return handle

    def _start_lifecycle(self, handle: WorkerHandle) -> None:
        task = asyncio.create_task(self._lifecycle(handle), name=f"worker-{handle.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)  # a retired worker's task is not kept for the router's life

    async def retire(self, wid: str, why: str) -> None:
        """Stop worker `wid` for good (`stopping`: out of rotation, SIGTERM so it finishes its
        requests in flight, SIGKILL after the stop timeout, not restarted) and drop its handle once
        its process has exited. A later worker on that device continues its process generations,
        so nothing remembered of the old process is taken for the new."""
        handle = self.workers.get(wid)
        if handle is None:
            return
        handle.retiring = why
        self._set(handle, WorkerState.STOPPING, why)
        process = handle.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), self.settings.worker_stop_timeout_s)
            if process.returncode is None:
                logger.warning("worker %s did not stop within %.0fs; killing it", wid,
                               self.settings.worker_stop_timeout_s)
                kill(handle)
                await process.wait()
        for _ in range(100):  # its lifecycle task drops the client and returns
            if handle.client is None:
                break
            await asyncio.sleep(0.05)
        self._generations[wid] = handle.generation
        if self.workers.get(wid) is handle:
            del self.workers[wid]
        logger.info("worker %s stopped (%s)", wid, why)
        self._notify()

    async def stop(self) -> None:
        """SIGTERM every worker (they drain), SIGKILL what is left after the timeout, clean up. The
        lifecycle tasks end first, so none is left spawning a worker (a restart in flight) that
        the signals would miss and that would outlive the router."""
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        for task in (tasks := list(self._tasks)):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        procs = [h.process for h in self.workers.values() if h.process and h.process.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if procs:
            done, pending = await asyncio.wait(
                [asyncio.create_task(p.wait()) for p in procs], timeout=self.settings.worker_stop_timeout_s
            )
            for proc in procs:
                if proc.returncode is None:
                    logger.warning("worker pid %s did not stop within %.0fs; killing it", proc.pid,
                                   self.settings.worker_stop_timeout_s)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for handle in self.workers.values():
            await self._drop_client(handle)
        if self.run_dir is not None:
            close_run(self.run_dir)

    # --- setup -------------------------------------------------------------------------
    def _init_run_dir(self) -> None:
        self.run_dir = open_run(tier=self.settings.kv_host_bytes != 0)

    def _init_handles(self) -> None:
        assert self.run_dir is not None
        specs = build_worker_specs(self._devices, self.settings, self.run_dir, os.getpid(), models=self._models)
        specs = with_pipelines(specs, self._pipelines, self.settings, self.run_dir, self._threads)
        self.workers = {spec.id: self._handle(spec) for spec in specs}

    def _handle(self, spec) -> WorkerHandle:
        policy = BreakerPolicy(self.settings.breaker_failures, self.settings.breaker_cooldown_s)
        return WorkerHandle(spec, breaker=CircuitBreaker(policy), generation=self._generations.get(spec.id, 0))

    # --- state -------------------------------------------------------------------------
    def _set(self, handle: WorkerHandle, state: str, reason: str | None = None, logged: bool = False) -> None:
        """Move `handle` to `state`; one log line unless the caller logs the change itself (`logged`)."""
        if handle.state != state and not logged:
            logger.info("worker %s: %s -> %s%s", handle.id, handle.state, state, f" ({reason})" if reason else "")
        handle.state = state
        handle.reason = reason
        if state != WorkerState.READY and state != WorkerState.UNHEALTHY:
            handle.ready_since = None
        self._notify()

    def _notify(self) -> None:  # wakes whoever waits in `wait_changed`
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------
    async def _lifecycle(self, handle: WorkerHandle) -> None:
        """Spawn -> wait until ready (the status file says so, `/health` answers 200, `/capability`
        read) -> health-check until it exits -> `decide_exit`, and again until it is retired, failed
        for good or the router stops. A worker that failed to start (exit code 3) has its status
        file name the step: bind, capability, load, kernelize, fp8."""
        policy = RestartPolicy.from_settings(self.settings)
        history = ExitHistory.start(policy, handle.restarts)
        while not self._stopping and handle.retiring is None:
            try:
                await self._spawn(handle)
            except OSError as e:
                self._set(handle, WorkerState.FAILED, f"could not start `{' '.join(handle.spec.command)}`: {e}",
                          logged=True)
                logger.error("worker %s failed: %s", handle.id, handle.reason)
                return
            watcher = asyncio.create_task(self._watch(handle))
            assert handle.process is not None
            try:
                returncode = await handle.process.wait()
            finally:  # the process exited, or `stop()` ends this task while it runs
                # Python 3.11's wait_for can swallow a cancel that races its inner wait, so the
                # watcher also stops by itself once the process has exited; never wait on it forever.
                watcher.cancel()
            await asyncio.wait([watcher], timeout=5.0)
            served_for = time.monotonic() - handle.ready_since if handle.ready_since is not None else None
            await self._drop_client(handle)
            if self._stopping or handle.retiring is not None:
                return
            # Decide (server/fleet/exits.py): failed to start, or restart after a backoff.
            decision = decide_exit(returncode, read_status(handle.spec.status_path), history, policy, served_for,
                                   handle.exit_cause)
            handle.last_exit, handle.exit_cause = decision.last_exit, None
            if not decision.restart:
                self._set(handle, WorkerState.FAILED, decision.reason, logged=True)  # the reason once, here
                logger.error("worker %s failed: %s", handle.id, handle.reason)
                return
            history = decision.history
            handle.restarts = history.restarts
            self._set(handle, WorkerState.RESTARTING, decision.reason)
            logger.warning("worker %s (pid %s) %s; restarting in %.1fs", handle.id, handle.pid, handle.last_exit,
                           decision.wait_s)
            await self._sleep_unless_stopping(decision.wait_s)

    async def _spawn(self, handle: WorkerHandle) -> None:
        spec = handle.spec = with_runtime_loras(handle.spec, self.settings, self.runtime_loras)
        for stale in (spec.socket_path, spec.status_path):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        handle.info = None
        handle.step = None
        handle.probe = None
        handle.breaker.reset()  # a new process starts with a clean record
        spec.write_config()  # what `python -m workers --config FILE` reads
        handle.process = await spawn(spec.argv, spec.environ())
        handle.pid = handle.process.pid
        handle.generation += 1
        handle.client = WorkerClient(spec.socket_path)
        if handle.state != WorkerState.RESTARTING:
            self._set(handle, WorkerState.STARTING, "spawned")
        logger.info("worker %s: started pid %s (%s; %d threads: %s)", handle.id, handle.pid, spec.device.name,
                    spec.threads, self.threads_reason)

    async def _drop_client(self, handle: WorkerHandle) -> None:
        if (client := handle.client) is not None:
            handle.client = None
            await client.aclose()

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        assert self._stop_event is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), seconds)

    # --- readiness and health ----------------------------------------------------------
    async def _watch(self, handle: WorkerHandle) -> None:
        if await self._wait_ready(handle):
            await self._health_loop(handle)

    async def _wait_ready(self, handle: WorkerHandle) -> bool:
        """Poll the status file and `/health` until ready; False if it failed or timed out."""
        spec, client = handle.spec, handle.client
        assert client is not None
        started = time.monotonic()
        delay = 0.05
        while alive(handle):
            status = read_status(spec.status_path)
            if status.get("state") == WorkerStatus.FAILED:
                handle.reason = describe_failure(-1, status)
                return False  # the worker exits with code 3; the lifecycle marks it failed
            if status.get("step") and status.get("step") != handle.step:
                handle.step = status["step"]
                handle.reason = f"step: {handle.step}"
            if spec.socket_path.exists() and status.get("state") in (None, WorkerStatus.READY):
                info = await ready_capability(client)
                if info is not None:
                    handle.info = info
                    handle.ready_since = time.monotonic()
                    self._set(handle, WorkerState.READY)
                    return True
            if time.monotonic() - started > self.settings.startup_timeout_s:
                handle.reason = f"not ready after {self.settings.startup_timeout_s:.0f}s"
                logger.error("worker %s %s; killing it", handle.id, handle.reason)
                kill(handle)
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        return False

    async def _health_loop(self, handle: WorkerHandle) -> None:
        s, client = self.settings, handle.client
        assert client is not None
        tally, watch = Tally(s.unhealthy_after_failures, s.unhealthy_kill_after_s), CpuWatch(handle.pid)
        while alive(handle):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(handle.check_now.wait(), s.health_interval_s)
            urgent = handle.check_now.is_set()
            handle.check_now.clear()
            verdict = handle.probe = await probe(client, s.health_timeout_s, s.stall_timeout_s, handle.pid, watch)
            if verdict.capacity is not None:
                handle.live_capacity = verdict.capacity
            if verdict.kind in (Probe.BUSY, Probe.SLOW) and tally.busy == 0:
                logger.info("worker %s: %s", handle.id, verdict.why)
            act, why = tally.count(verdict, urgent, handle.state == WorkerState.READY)
            if act == Act.REPLACE:
                await self._replace_hung(handle, why)
                return
            if act == Act.RECOVERED and handle.state == WorkerState.UNHEALTHY:
                self._set(handle, WorkerState.READY)
            elif act == Act.UNHEALTHY:
                self._set(handle, WorkerState.UNHEALTHY, why)
            elif act == Act.KILL:
                logger.error("worker %s unhealthy for %.0fs (%s); killing it", handle.id, s.unhealthy_kill_after_s, why)
                handle.stopping(f"unhealthy: {why}")
                kill(handle)
                return

    async def _replace_hung(self, handle: WorkerHandle, why: str) -> None:
        """Out of rotation now, its requests back (broken connections: retried or migrated by
        the dispatcher), then SIGTERM and, after a grace period, SIGKILL; the lifecycle restarts it."""
        logger.error("worker %s (pid %s) is hung (%s): moving its requests and restarting it", handle.id,
                     handle.pid, why)
        handle.stopping(f"hung: {why}")
        self._set(handle, WorkerState.UNHEALTHY, handle.exit_cause)
        if handle.client is not None:
            handle.client.abort()
        process = handle.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
            process.send_signal(signal.SIGCONT)  # a stopped process can only act on SIGTERM once continued
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), self.settings.hang_kill_grace_s)
        if process.returncode is None:
            logger.error("worker %s did not stop within %.0fs of SIGTERM; killing it", handle.id,
                         self.settings.hang_kill_grace_s)
            kill(handle)
