"""Worker processes for pipeline tests and benchmarks: one worker, or a pipeline's first stage with its plan.

`Served(tmp, name, model, ["sm_80", "sm_86"])` starts `python -m workers` for the first device and,
with more than one device, writes the plan file the router would (workers/contract/pipeline.py:
each later stage's `WorkerConfig`, from the same flags) so the first stage starts the others;
`partition` sets each stage's layers (default: even). As the router does, it gives each simulated
stage its `$HETSERVE_SLOWDOWN` factor (from `env`) in its configuration. `generate` posts one TGI
`/generate` over the Unix socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from workers.contract import WorkerConfig
from workers.contract.pipeline import PipelinePlan, StagePlan
from workers.contract.slowdown import ENV_SLOWDOWN, slowdown_factor

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("--max-batch", "4", "--kv-block-size", "8", "--max-num-batched-tokens", "16", "--dtype", "float32",
          "--compile", "off")


def _env(extra: dict | None = None) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}, **(extra or {})}


class Served:
    """One worker, or the first stage of a pipeline, started as `python -m workers`."""

    def __init__(self, tmp: Path, name: str, model: Path, simulate: list[str], extra=(), *, threads: int = 1,
                 partition: list[int] | None = None, env: dict | None = None, common=COMMON,
                 timing: tuple[str, tuple[str, ...]] | None = None):
        """`timing`: (the model's key, each stage's device key) under which the first stage records
        what the stages measured (workers/contract/stage_timing.py; the file from `env`'s
        `HETSERVE_STAGE_TIMINGS`); None: nothing recorded."""
        self.tmp, self.name = tmp, name
        self.sock, self.status = tmp / f"{name}.sock", tmp / f"{name}.json"
        argv = ["--model", str(model), "--threads", str(threads), *common, *extra]
        slowdown = (env or {}).get(ENV_SLOWDOWN, "")

        def slowed(worker_id: str) -> list[str]:  # the router's `device_slowdown`: every stage here is simulated
            factor = slowdown_factor(slowdown, worker_id)
            return ["--slowdown", str(factor)] if factor != 1.0 else []

        plan_args: list[str] = []
        if len(simulate) > 1:
            n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
            counts = partition or [round((i + 1) * n / len(simulate)) - round(i * n / len(simulate))
                                   for i in range(len(simulate))]
            bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
            model_key, keys = timing or ("", ("",) * len(simulate))
            stages = [StagePlan(bounds[0], bounds[1], None, (), f"{name}-0", keys[0])]
            for r in range(1, len(simulate)):
                config = WorkerConfig.from_argv(["--socket", str(tmp / f"{name}-{r}.sock"), "--worker-id",
                                                 f"{name}-{r}", "--simulate", simulate[r], "--status-file",
                                                 str(tmp / f"{name}-{r}.json"), *argv, *slowed(f"{name}-{r}")],
                                                environ={})
                stages.append(StagePlan(bounds[r], bounds[r + 1], config, (), f"{name}-{r}", keys[r]))
            PipelinePlan("127.0.0.1", tuple(stages), 60.0,
                         timing_model=model_key).write(tmp / f"{name}.plan.json")
            plan_args = ["--pipeline-plan", str(tmp / f"{name}.plan.json")]
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "--socket", str(self.sock), "--status-file", str(self.status),
             "--worker-id", f"{name}-0", "--simulate", simulate[0], *argv, *slowed(f"{name}-0"), *plan_args],
            cwd=ROOT, env=_env(env), stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                state = json.loads(self.status.read_text()).get("state")
            except (OSError, ValueError):
                state = None
            if state == "ready":
                return
            if state in ("failed", "fatal") or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready: {self.status.read_text() if self.status.exists() else ''}\n"
                             f"{(self.tmp / f'{self.name}.log').read_text()[-4000:]}")

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://w", timeout=300)

    def generate(self, prompt: str, n: int = 12, **parameters) -> dict:
        with self.client() as c:
            r = c.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True,
                                                                           **parameters}})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
