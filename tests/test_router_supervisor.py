"""The supervisor on its own (asyncio, stand-in workers): environment, run directory, give-up rules."""

from __future__ import annotations

import asyncio
import os
import stat
import sys

import pytest

from server.config.settings import RouterSettings
from server.fleet.supervisor import Supervisor
from tests.router_harness import FAKE_WORKER, alive
from workers.contract import WorkerConfig, parse_simulate

pytestmark = pytest.mark.slow


def _settings(**kw) -> RouterSettings:
    return RouterSettings(worker_command=(sys.executable, str(FAKE_WORKER)), **kw)


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_workers_get_their_device_environment_a_private_run_dir_and_no_orphans(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # must not leak into the workers
    monkeypatch.setenv("HETSERVE_SIMULATE", "sm_75")

    async def main():
        sup = Supervisor(parse_simulate("sm_80,sm_89"), _settings(threads=4))
        await sup.start()
        try:
            assert await sup.wait_settled(60)
            mode = stat.S_IMODE(os.stat(sup.run_dir).st_mode)
            assert mode == 0o700, oct(mode)
            envs = {h.id: _environ(h.pid) for h in sup.workers.values()}
            configs = {h.id: WorkerConfig.read(h.spec.config_path) for h in sup.workers.values()}
            pids = [h.pid for h in sup.workers.values()]
            run_dir = sup.run_dir
        finally:
            await sup.stop()
        return envs, configs, pids, run_dir

    envs, configs, pids, run_dir = asyncio.run(main())
    for i, (wid, token) in enumerate((("gpu0", "sm_80"), ("gpu1", "sm_89"))):
        env = envs[wid]
        assert env["HETSERVE_SIMULATE"] == token and env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["HETSERVE_DEVICE_INDEX"] == str(i)
        assert env["HETSERVE_DEVICE_UUID"].startswith("GPU-") and env["OMP_NUM_THREADS"] == "2"
        config = configs[wid]  # the file each was started with
        assert config.threads == 2  # 4 threads shared by 2 workers
        assert config.parent_pid == os.getpid()
        assert config.simulate == token
    assert not any(alive(p) for p in pids)
    assert not run_dir.exists()


def test_a_worker_that_keeps_crashing_before_ready_is_given_up(monkeypatch):
    monkeypatch.setenv("FAKE_EXIT_AT_START", "1")

    async def main():
        sup = Supervisor(parse_simulate("sm_90"), _settings(restart_backoff_initial_s=0.01, max_startup_crashes=3))
        await sup.start()
        try:
            assert await sup.wait_settled(60)
            return sup.workers["gpu0"]
        finally:
            await sup.stop()

    h = asyncio.run(main())
    assert h.state == "failed" and h.restarts == 2
    assert "crashed 3 times before becoming ready" in h.reason and "exited with code 1" in h.reason


def test_a_missing_worker_command_is_failed_with_the_os_error():
    async def main():
        sup = Supervisor(parse_simulate("sm_90"), RouterSettings(worker_command=("/nonexistent/python",)))
        await sup.start()
        try:
            assert await sup.wait_settled(10)
            return sup.workers["gpu0"]
        finally:
            await sup.stop()

    h = asyncio.run(main())
    assert h.state == "failed" and "could not start" in h.reason and "/nonexistent/python" in h.reason


def test_a_worker_spawned_while_stopping_does_not_outlive_the_router(monkeypatch):
    """Guards `stop()` ending the lifecycle tasks before it signals the workers (server/fleet/
    supervisor.py): a restart whose spawn is under way when stopping begins used to start a worker
    after `stop()` had listed whom to signal, and cancelling its task then left it running (the
    stand-in worker here dies by itself once the run directory is gone; a real one loads its model
    first). No worker may start once stopping began."""
    import server.fleet.supervisor as supervisor

    spawned: list[tuple[int, bool]] = []  # pid, and whether stopping had begun
    real_spawn = supervisor.spawn

    async def main():
        sup = Supervisor(parse_simulate("sm_80,sm_89"), _settings(restart_backoff_initial_s=0.01))

        async def slow_spawn(argv, environ):
            if sup.workers["gpu1"].generation and argv == sup.workers["gpu1"].spec.argv:  # gpu1's restart
                while not sup._stopping:  # held until stopping begins, then started
                    await asyncio.sleep(0.01)
            proc = await real_spawn(argv, environ)
            spawned.append((proc.pid, sup._stopping))
            return proc

        monkeypatch.setattr(supervisor, "spawn", slow_spawn)
        await sup.start()
        try:
            assert await sup.wait_settled(60)
            sup.workers["gpu1"].process.kill()  # gpu1 crashes; its restart waits in `spawn`
            for _ in range(500):
                if sup.workers["gpu1"].state == "restarting":
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
        finally:
            await sup.stop()
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert len(spawned) >= 2
    assert not [pid for pid, stopping in spawned if stopping], "a worker started after stopping began"
    assert not any(alive(pid) for pid, _ in spawned)
